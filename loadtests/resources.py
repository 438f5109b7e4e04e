"""Where the files shipped beside the code live: the example configs (configs/) and the harness's data
(loadtests/data/). Everything the harness reads from them goes through `shipped`."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shipped(*parts: str) -> Path:
    """A shipped file or folder, e.g. `shipped("configs", "ngram.yaml")`, `shipped("loadtests", "data")`."""
    return ROOT.joinpath(*parts)
