"""`specserve serve --tensor-parallel-size N`: start the N ranks of one model and watch them.

On one machine the ranks are started here, each with the environment MLX's launcher gives a ring-backend
rank (`MLX_RANK`, `MLX_HOSTFILE` naming every rank's address), its own share of the cores and
`OMP_NUM_THREADS` to match. Across machines (`--hostfile`, MLX's hostfile format) MLX's launcher starts
them over ssh. Rank 0 serves HTTP; the others only follow its forwards (engine/follower.py).

This process stays as the supervisor: SIGINT/SIGTERM go to rank 0 (a graceful stop; it then tells the
others to stop), a rank that ends early stops the rest, and its status is the exit status.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from server.settings import ServerSettings

logger = logging.getLogger("specserve.tp")

# Where rank 0 writes its pid when MLX's launcher started it, so that a stop reaches it directly (a signal
# to the launcher kills the launcher first, and with it the ranks' output).
PIDFILE_ENV = "SPECSERVE_TP_PIDFILE"
_POLL_S = 0.2
_RANKS_GRACE_S = 15.0  # after rank 0 ends, the others get this long to follow before they are killed


def launch(settings: ServerSettings, argv: Sequence[str]) -> int:
    """Start the ranks of `specserve <argv>` (the same command line: each rank sees MLX_RANK and takes
    its part) and wait for them; returns the exit status."""
    n = settings.tensor_parallel_size
    cmd = [sys.executable, "-m", "server.cli", *argv]
    with tempfile.TemporaryDirectory(prefix="specserve-tp-") as tmp:
        pidfile = Path(tmp) / "rank0.pid"
        if settings.hostfile is not None:
            procs = [_start_with_mlx_launch(settings.hostfile, cmd, pidfile)]
        else:
            procs = _start_local(n, cmd, Path(tmp))
        return _supervise(procs, settings.shutdown_timeout, pidfile)


def _start_local(n: int, cmd: list[str], tmp: Path) -> list[subprocess.Popen[bytes]]:
    hostfile = tmp / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(n)]))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = max(1, len(cpus) // n) if cpus else max(1, (os.cpu_count() or 1) // n)
    procs = []
    for rank in range(n):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile), SPECSERVE_TP_BACKEND="ring")
        env.setdefault("OMP_NUM_THREADS", str(share))
        # Each rank on its own cores: two ranks' threads sharing a core wait a scheduler tick at every
        # all-sum.
        mine = cpus[rank * share : (rank + 1) * share] if len(cpus) >= n else []
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_child_setup(mine),  # noqa: PLW1509
                                      start_new_session=True))
    logger.info("started %d tensor-parallel ranks on this machine (ring backend, %s)", n,
                f"{share} core(s) each" if cpus else "no core pinning")
    return procs


def _start_with_mlx_launch(hostfile: str, cmd: list[str], pidfile: Path) -> subprocess.Popen[bytes]:
    launcher = shutil.which("mlx.launch", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                               os.environ.get("PATH", "")]))
    if launcher is None:
        raise FileNotFoundError("mlx.launch (MLX's launcher) is not installed next to this Python")
    logger.info("starting the ranks of %s with MLX's launcher", hostfile)
    try:
        data = json.loads(Path(hostfile).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--hostfile {hostfile}: {e}") from e
    # The backend the launcher sets up is the one each rank must join (not the first that starts).
    backend = data.get("backend", "") if isinstance(data, dict) else ""
    env = ["--env", f"{PIDFILE_ENV}={pidfile}"]
    if backend in ("ring", "mpi", "jaccl"):
        env += ["--env", f"SPECSERVE_TP_BACKEND={backend}"]
    return subprocess.Popen([launcher, "--hostfile", hostfile, *env, "--", *cmd], start_new_session=True,
                            stdin=subprocess.DEVNULL)


def _child_setup(cpus: list[int]):  # noqa: ANN202 - a preexec_fn
    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        _die_with_parent()
    return setup


def _die_with_parent() -> None:
    """Linux: the rank gets SIGTERM if the supervisor dies, so that no rank outlives it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def note_rank0_pid() -> None:
    """Rank 0 under MLX's launcher: tell the supervisor (on this machine) where to send a stop."""
    path = os.environ.get(PIDFILE_ENV)
    if path:
        with contextlib.suppress(OSError):  # rank 0 on another machine: the supervisor stops the launcher
            Path(path).write_text(str(os.getpid()))


def _supervise(procs: list[subprocess.Popen[bytes]], grace_s: float, pidfile: Path) -> int:
    """Wait for the ranks (or MLX's launcher); a signal stops rank 0 gracefully. Returns rank 0's (the
    launcher's) status, or that of the rank that ended first with an error."""
    stopping: list[float] = []

    def stop_rank0() -> None:
        try:
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            _signal(procs[0], signal.SIGTERM)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stopping:
            stopping.append(time.monotonic())
            stop_rank0()

    original = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status: int | None = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if status is None and codes[0] is not None:
                status = codes[0]
                stopping.append(time.monotonic())
            elif status is None and not stopping and any(c is not None for c in codes):
                i = next(i for i, c in enumerate(codes) if c is not None)
                # A follower never ends on its own while rank 0 serves: the model is broken either way.
                status = codes[i] or 1
                logger.error("tensor-parallel rank %d ended (status %s); stopping the others", i, codes[i])
                stop_rank0()
                stopping.append(time.monotonic())
            if stopping and time.monotonic() - stopping[0] > grace_s + _RANKS_GRACE_S:
                for p in procs:
                    _signal(p, signal.SIGKILL)
            time.sleep(_POLL_S)
        if status is None or status == 0:
            status = procs[0].returncode
        return status if status >= 0 else 128 - status
    finally:
        for sig, handler in original.items():
            signal.signal(sig, handler)


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)


def run_follower(settings: ServerSettings) -> int:
    """A rank other than 0: follow rank 0's forwards until it stops (0) or goes away (1)."""
    from engine.config import EngineConfig
    from engine.follower import build_follower, follow

    # Rank 0 stops the group; a signal here would only break the step it is running.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    kwargs = settings.engine_config_kwargs() | {"speculative_config": None}
    try:
        runner = build_follower(EngineConfig(**kwargs, show_progress=False))
        follow(runner)
    except (ValueError, FileNotFoundError) as e:
        logger.error("cannot start: %s", e)
        return 2
    except RuntimeError as e:  # the ring lost a peer: rank 0 is gone
        logger.error("the tensor-parallel group broke: %s", e)
        return 1
    logger.info("rank 0 stopped the group")
    return 0
