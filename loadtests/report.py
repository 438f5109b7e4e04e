"""Result files and tables: the JSON document `bench serve` and `bench sweep` write, the environment it
was measured in, stdout / Markdown tables."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = "specserve-bench/1"

Column = tuple[str, Callable[[dict[str, Any]], Any]]


def num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _spec(level: dict[str, Any], key: str, fmt: str) -> str:
    return num((level.get("spec_decode") or {}).get(key), fmt)


def level_columns(with_label: bool = True) -> list[Column]:
    cols: list[Column] = []
    if with_label:
        cols += [("server", lambda r: r["label"]), ("dataset", lambda r: r["dataset"])]
    cols += [
        ("level", lambda r: r["level"]),
        ("ok/n", lambda r: f"{r['completed']}/{r['num_requests']}"),
        ("tok/s", lambda r: num(r["output_throughput_tok_s"])),
        ("req/s", lambda r: num(r["request_throughput_rps"], ".2f")),
    ]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("e2e", "e2e_ms")):
        for p in ("p50", "p90", "p99"):
            cols.append((f"{name} {p} ms", lambda r, k=key, q=p: num(r[k][q], ".0f")))
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
    """Every level of every run, tagged with its run's label and dataset."""
    return [{"label": run["label"], "dataset": run["dataset"], **lvl}
            for run in runs for lvl in run["levels"]]


def serving_result(level: dict[str, Any]) -> str:
    """One level as `vllm bench serve` prints it, acceptance included when the server drafts."""
    width = 50

    def head(title: str, fill: str = "-") -> str:
        return f" {title} ".center(width, fill)

    def row(name: str, value: Any) -> str:
        return f"{name:<40}{value:<10}"

    rate = level.get("request_rate")
    lines = [head("Serving Benchmark Result", "="),
             row("Successful requests:", level["completed"]), row("Failed requests:", level["failed"]),
             row("Request rate configured (RPS):", "inf" if rate is None else f"{rate:.2f}"),
             row("Maximum request concurrency:", level.get("max_concurrency") or "none"),
             row("Benchmark duration (s):", f"{level['duration_s']:.2f}"),
             row("Total input tokens:", level["input_tokens"]),
             row("Total generated tokens:", level["output_tokens"]),
             row("Request throughput (req/s):", num(level["request_throughput_rps"], ".2f")),
             row("Output token throughput (tok/s):", num(level["output_throughput_tok_s"], ".2f"))]
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2e_ms", "End-to-end Latency", "E2EL")):
        d = level[key]
        lines += [head(title), row(f"Mean {short} (ms):", num(d["mean"], ".2f"))]
        lines += [row(f"{'Median' if p == 'p50' else p.upper()} {short} (ms):", num(d[p], ".2f"))
                  for p in ("p50", "p90", "p99")]
    spec = level.get("spec_decode")
    if spec and spec["num_drafts"]:
        per_pos = ", ".join(num(r, ".2f") for r in spec["acceptance_rate_per_position"])
        lines += [head("Speculative Decoding"),
                  row("Acceptance rate (%):", num(100 * (spec["acceptance_rate"] or 0), ".2f")),
                  row("Acceptance length:", num(spec["mean_acceptance_length"], ".2f")),
                  row("Drafts:", spec["num_drafts"]), row("Draft tokens:", spec["num_draft_tokens"]),
                  row("Accepted tokens:", spec["num_accepted_tokens"]),
                  "Per-position acceptance rate: " + per_pos]
    for name, cls in (level.get("classes") or {}).items():
        lines += [head(f"Class {name}"),
                  row("Successful requests:", f"{cls['completed']}/{cls['num_requests']}"),
                  row("Output token throughput (tok/s):", num(cls["output_throughput_tok_s"], ".2f"))]
        lines += [row(f"{'Median' if p == 'p50' else p.upper()} {short} (ms):", num(cls[key][p], ".2f"))
                  for key, short in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2EL"))
                  for p in ("p50", "p99")]
    if level.get("errors"):
        lines += [head("Errors"), *level["errors"]]
    return "\n".join([*lines, "=" * width])


def load_key(level: dict[str, Any]) -> str:
    """A level summary's load alone ("c8" of "c8-t0.4": `runner.Level.load_key`)."""
    t = level.get("temperature")
    return level["level"] if t is None else level["level"].removesuffix(f"-t{t:g}")


def slug(label: str) -> str:
    """A label as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def package_versions(packages: tuple[str, ...]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in packages:
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
        "client_packages": package_versions(("specserve", "httpx", "mlx", "mlx-lm", "matplotlib")),
    }


def result_document(kind: str, config: dict[str, Any], runs: list[dict[str, Any]],
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "kind": kind,  # "serve" | "sweep"
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": sys.argv,
        "environment": environment(),
        "config": config,
        "runs": runs,
        **(extra or {}),
    }


# A list of numbers as json.dumps(indent=1) lays it out, one element a line (never inside a string: JSON
# strings hold no raw newlines).
_NUMBER_LIST = re.compile(r"\[\n\s*(?:-?[0-9.eE+-]+,\n\s*)*-?[0-9.eE+-]+\n\s*\]")


def dumps(doc: Any) -> str:
    """JSON with a key a line, but each list of numbers (token ids, per-round figures) on one line: the
    same data, a fraction of the bytes of committed results."""
    def one_line(m: re.Match[str]) -> str:
        return "[" + ", ".join(x.rstrip(",") for x in m.group(0)[1:-1].split()) + "]"

    return _NUMBER_LIST.sub(one_line, json.dumps(doc, indent=1))


def write_json(doc: dict[str, Any], path: str | Path, keep_requests: bool = True) -> Path:
    """Write the result; `keep_requests=False` drops per-request records to keep committed files small."""
    if not keep_requests:
        doc = {**doc, "runs": [{**run, "levels": [{k: v for k, v in lvl.items() if k != "requests"}
                                                  for lvl in run["levels"]]} for run in doc["runs"]]}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dumps(doc) + "\n")
    return p


def load_json(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a bench result ({SCHEMA})")
    return doc
