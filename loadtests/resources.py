"""Where the harness's shipped data lives (loadtests/data/, found through importlib.resources so that a
non-editable install finds it too); the example configs are `specserve_configs`'."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout (for what only a checkout has)


def data(*parts: str) -> Path:
    """A file or folder under loadtests/data/, e.g. `data("chat.jsonl")`."""
    return Path(str(files(__package__).joinpath("data", *parts)))
