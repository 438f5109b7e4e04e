"""Summarise `specserve serve --step-trace FILE` traces: where each server's time went, by step shape.

    python -m loadtests.traces results/tmp/trace-*.jsonl [--json OUT.json]

Per file: steps and seconds in prefill-carrying steps and in decode/verify steps, and per request count
the decode steps without drafts and with drafts (mean seconds, mean drafts, seconds per draft). Two
servers' decode steps of the same request count without drafts did the same work: when their times
differ, the machine did, whatever the two servers chose.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(path: str) -> list[dict[str, Any]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.endswith("}"):  # a line cut by a killed server is skipped
                out.append(json.loads(line))
    return out


def is_decode(rec: dict[str, Any]) -> bool:
    """A step of decode rows and their drafts only (no prefill chunk)."""
    return rec["tokens"] == rec["requests"] + rec.get("drafts_verified", 0)


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    decode = [r for r in records if is_decode(r)]
    other = [r for r in records if not is_decode(r)]
    shapes: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: {"plain": [], "drafting": []})
    for r in decode:
        shapes[r["requests"]]["drafting" if r.get("drafts_verified", 0) else "plain"].append(r)
    by_rows = []
    for rows in sorted(shapes):
        plain, drafting = shapes[rows]["plain"], shapes[rows]["drafting"]
        row: dict[str, Any] = {"requests": rows, "plain_steps": len(plain), "drafting_steps": len(drafting),
                               "plain_s": _mean([r["step_s"] for r in plain]),
                               "drafting_s": _mean([r["step_s"] for r in drafting]),
                               "drafts_per_step": _mean([r["drafts_verified"] for r in drafting])}
        if row["plain_s"] is not None and row["drafting_s"] is not None and row["drafts_per_step"]:
            row["s_per_draft"] = (row["drafting_s"] - row["plain_s"]) / row["drafts_per_step"]
        by_rows.append(row)
    span = records[-1]["t"] - records[0]["t"] + records[0]["step_s"] if records else 0.0
    return {
        "steps": len(records), "span_s": span,
        "busy_s": sum(r["step_s"] for r in records),
        "propose_s": sum(r.get("propose_s", 0.0) for r in records),
        "prefill_steps": len(other), "prefill_s": sum(r["step_s"] for r in other),
        "decode_steps": len(decode), "decode_s": sum(r["step_s"] for r in decode),
        "generated": sum(r["generated"] for r in records),
        "drafts_verified": sum(r.get("drafts_verified", 0) for r in records),
        "drafts_accepted": sum(r.get("drafts_accepted", 0) for r in records),
        "by_requests": by_rows,
    }


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def render(name: str, s: dict[str, Any], top: int) -> str:
    lines = [f"{name}: {s['steps']} steps over {s['span_s']:.1f} s (busy {s['busy_s']:.1f} s, proposer "
             f"{s['propose_s']:.1f} s); prefill-carrying {s['prefill_steps']} steps {s['prefill_s']:.1f} s, "
             f"decode/verify {s['decode_steps']} steps {s['decode_s']:.1f} s; {s['generated']} tokens out, "
             f"drafts {s['drafts_accepted']}/{s['drafts_verified']} accepted",
             "  requests | plain steps | plain ms | drafting steps | drafting ms | drafts/step | ms/draft"]
    rows = sorted(s["by_requests"], key=lambda r: -(r["plain_steps"] + r["drafting_steps"]))[:top]
    for r in sorted(rows, key=lambda r: r["requests"]):
        per = r.get("s_per_draft")
        lines.append(f"  {r['requests']:8d} | {r['plain_steps']:11d} | {_ms(r['plain_s']):>8} | "
                     f"{r['drafting_steps']:14d} | {_ms(r['drafting_s']):>11} | "
                     f"{r['drafts_per_step'] or 0:11.1f} | {_ms(per) if per is not None else '-':>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="JSONL files written by --step-trace")
    ap.add_argument("--top", type=int, default=6, help="request counts shown per file (the most stepped)")
    ap.add_argument("--json", default=None, help="also write the summaries here")
    args = ap.parse_args(argv)
    out = {}
    for path in args.traces:
        recs = load(path)
        if not recs:
            print(f"{path}: no steps", file=sys.stderr)
            continue
        out[path] = summarise(recs)
        print(render(Path(path).name, out[path], args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
