"""`specserve serve --tensor-parallel-size N`, the command line's side: the server's settings handed to
engine/tensor_parallel/ (the group, the follower loop and the rank launcher)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from engine.tensor_parallel import launcher
from server.settings import ServerSettings


def launch(settings: ServerSettings, argv: Sequence[str]) -> int:
    """Start the ranks of `specserve <argv>` (each runs the same command line and takes its part from
    MLX_RANK) and supervise them; returns the exit status. Rank 0 serves HTTP."""
    return launcher.launch([sys.executable, "-m", "server.cli", *argv], settings.tensor_parallel_size,
                           settings.hostfile, settings.shutdown_timeout)


def run_follower(settings: ServerSettings) -> int:
    """A rank other than 0: follow rank 0's forwards (no speculation: rank 0 drafts) until it stops."""
    from engine.tensor_parallel.follower import run_follower as follow  # imports MLX: after platform.setup()

    return follow(settings.engine_config_kwargs() | {"speculative_config": None})
