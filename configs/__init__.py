"""The files specserve ships beside its code: server configs (`specserve serve --config mtp`), the MTP
assistant trained for the default model, the training prompt sets, the default model's chat template with
tool support (templates/smollm2-tools.jinja).

pyproject.toml installs this folder as the package `specserve_configs`, so a wheel and an editable
checkout find these files the same way, through importlib.resources.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def shipped(*parts: str) -> Path:
    """A shipped file or folder, e.g. `shipped("assistants", "smollm2-135m-mtp")`."""
    return Path(str(files(__name__).joinpath(*parts)))


def server_configs() -> dict[str, Path]:
    """{name: path} of the shipped server configs (`mtp` -> .../mtp.yaml)."""
    return {p.stem: p for p in sorted(shipped().glob("*.yaml"))}
