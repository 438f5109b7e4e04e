"""Benchmark modes: "off" (no speculation) and one per example config in configs/*.yaml, named after the
file (configs/ngram.yaml -> "ngram"). The YAML files are the only place a mode's speculative config is
written; `--k` derives static-K variants from them ("ngram k=2").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import read_config_file
from specserve_configs import server_configs

OFF = "off"

Modes = dict[str, dict[str, Any] | None]  # label -> speculative config (None: no speculation)


def _spec_of(path: Path) -> dict[str, Any] | None:
    """The config's speculative config, its relative paths resolved as `specserve serve --config` does."""
    spec = read_config_file(str(path)).get("speculative_config")
    return spec if isinstance(spec, dict) else None


def config_files() -> dict[str, Path]:
    """Mode name -> its YAML file, for every example config that sets a speculative config."""
    return {name: p for name, p in server_configs().items() if _spec_of(p) is not None}


def available() -> list[str]:
    return [OFF, *config_files()]


def speculative_config(name: str) -> dict[str, Any] | None:
    """The speculative config of mode `name` (the engine validates it when it starts)."""
    if name == OFF:
        return None
    files = config_files()
    if name not in files:
        raise ValueError(f"unknown mode {name!r} (one of {', '.join(available())})")
    return _spec_of(files[name])


def resolve(names: list[str], ks: list[int] | None = None,
            extra: list[tuple[str, dict[str, Any]]] | None = None) -> Modes:
    """Modes by name, each static-K mode once per K in `ks` (labelled "NAME k=K"; adaptive ones as
    they are), then `extra` (label, speculative config) pairs given on the command line."""
    out: Modes = {}
    for name in names:
        spec = speculative_config(name)
        if spec is None or not ks or spec.get("num_speculative_tokens") == "auto":
            out[name] = spec
        else:
            for k in ks:
                out[f"{name} k={k}"] = {**spec, "num_speculative_tokens": k}
    for label, spec in extra or []:
        if label in out:
            raise ValueError(f"mode label {label!r} given twice")
        out[label] = spec
    return out


def from_flags(modes: str | None, k: str | None, labelled: list[str], default: list[str]) -> Modes:
    """Modes from `--modes a,b` (or `default` without it), `--k 1,2` and `--speculative-config LABEL=JSON`."""
    names = [m.strip() for m in modes.split(",") if m.strip()] if modes else default
    ks = [int(x) for x in k.split(",") if x.strip()] if k else None
    extra = [labelled_config(text) for text in labelled]
    return resolve(names, ks, extra)


def labelled_config(text: str) -> tuple[str, dict]:
    """`LABEL=JSON` -> (label, config); the JSON starts at the first '={', so a label may hold '=' (k=2)."""
    at = text.find("={")
    label, value = (text[:at].strip(), text[at + 1:]) if at > 0 else parse_labelled(text)
    try:
        config = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config {text!r}: the value after LABEL= is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config {text!r}: expected a JSON object after LABEL=")
    return label, config


def parse_labelled(text: str) -> tuple[str, str]:
    """`LABEL=VALUE` -> (label, value); the label may not contain '='."""
    label, sep, value = text.partition("=")
    if not sep or not label.strip() or not value.strip():
        raise ValueError(f"expected LABEL=VALUE, got {text!r}")
    return label.strip(), value.strip()
