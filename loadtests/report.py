"""Tables (stdout and Markdown), the JSON result file, and the environment it was measured in."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = "specserve-loadtest/1"

Column = tuple[str, Callable[[dict[str, Any]], Any]]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _spec(level: dict[str, Any], key: str, fmt: str) -> str:
    spec = level.get("spec_decode") or {}
    return _num(spec.get(key), fmt)


def level_columns(with_label: bool = True) -> list[Column]:
    cols: list[Column] = []
    if with_label:
        cols += [("server", lambda r: r["label"]), ("workload", lambda r: r["workload"])]
    cols += [
        ("level", lambda r: r["level"]),
        ("ok/n", lambda r: f"{r['completed']}/{r['num_requests']}"),
        ("tok/s", lambda r: _num(r["output_throughput_tok_s"])),
        ("req/s", lambda r: _num(r["request_throughput_rps"], ".2f")),
    ]
    for name, key, fmt in (("TTFT", "ttft_s", _ms), ("TPOT", "tpot_s", _ms), ("e2e", "e2e_s", _s)):
        unit = "s" if key == "e2e_s" else "ms"
        for p in ("p50", "p90", "p99"):
            cols.append((f"{name} {p} {unit}", lambda r, k=key, q=p, f=fmt: f(r[k][q])))
    cols += [("acc rate", lambda r: _spec(r, "acceptance_rate", ".2f")),
             ("acc len", lambda r: _spec(r, "mean_acceptance_length", ".2f"))]
    return cols


def format_table(rows: list[dict[str, Any]], columns: list[Column], markdown: bool = False) -> str:
    cells = [[str(fn(r)) for _, fn in columns] for r in rows]
    heads = [h for h, _ in columns]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---" for _ in heads) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
    fmt = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))
    return "\n".join([fmt(heads), fmt(["-" * w for w in widths])] + [fmt(c) for c in cells])


def flat_levels(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every level of every run, tagged with its run's label and workload."""
    return [{"label": run["label"], "workload": run["workload"], **lvl}
            for run in runs for lvl in run["levels"]]


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in ("specserve", "httpx", "mlx", "mlx-lm", "matplotlib"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def environment() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "client_packages": _versions(),
    }


def result_document(kind: str, config: dict[str, Any], runs: list[dict[str, Any]],
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "kind": kind,  # "run" | "compare" | "suite"
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": environment(),
        "config": config,
        "runs": runs,
        **(extra or {}),
    }


def write_json(doc: dict[str, Any], path: str | Path, keep_requests: bool = True) -> Path:
    """Write the result; `keep_requests=False` drops per-request records to keep committed files small."""
    if not keep_requests:
        doc = {**doc, "runs": [{**run, "levels": [{k: v for k, v in lvl.items() if k != "requests"}
                                                  for lvl in run["levels"]]} for run in doc["runs"]]}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1) + "\n")
    return p


def load_json(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a load-test result ({SCHEMA})")
    return doc
