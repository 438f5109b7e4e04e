"""Compare spec_benchmark results: tokens/s against the baseline, acceptance, identical token ids.

    python -m tools.benchmark.summarize results/spec_benchmark/*.json [--markdown]

Files are grouped by batch size and max tokens; the baseline of a group is the file without a
speculative config. Every file is validated against the schema first.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.benchmark.schema import validate


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def rows(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    groups: dict[tuple[int, int, bool], list[dict[str, Any]]] = {}
    for d in docs:
        c = d["config"]
        groups.setdefault((c["batch_size"], c["max_tokens"], c["ignore_eos"]), []).append(d)
    for (batch, max_tokens, _), group in sorted(groups.items()):
        base = next((d for d in group if d["config"]["speculative_config"] is None), None)
        base_tps = base["summary"]["output_tokens_per_s"]["mean"] if base else None
        for d in group:
            tps = d["summary"]["output_tokens_per_s"]
            spec = d["summary"]["spec"] or {}
            same = None
            if base is not None and d["config"]["temperature"] == 0 and base["config"]["temperature"] == 0:
                same = all(r["token_ids"] == base["runs"][0]["token_ids"] for r in d["runs"])
            out.append({
                "label": d["label"], "batch": batch, "max_tokens": max_tokens,
                "tok_s": tps["mean"], "min": tps["min"], "max": tps["max"],
                "speedup": tps["mean"] / base_tps if base_tps and tps["mean"] else None,
                "acceptance": spec.get("acceptance_rate"), "length": spec.get("mean_acceptance_length"),
                "per_pos": spec.get("acceptance_rate_per_position") or [],
                "same_ids": same,
            })
    return out


def table(data: list[dict[str, Any]], markdown: bool) -> str:
    head = ["mode", "batch", "tok/s (min-max)", "x baseline", "acc. rate", "acc. len",
            "acceptance per position", "ids = baseline"]
    body = [[r["label"], str(r["batch"]),
             f"{_f(r['tok_s'], '.1f')} ({_f(r['min'], '.1f')}-{_f(r['max'], '.1f')})",
             _f(r["speedup"], ".2f"), _f(r["acceptance"], ".2f"), _f(r["length"], ".2f"),
             " ".join(_f(p, ".2f") for p in r["per_pos"]) or "-",
             "-" if r["same_ids"] is None else ("yes" if r["same_ids"] else "NO")] for r in data]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in [head, *body])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.benchmark.summarize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    docs = []
    for path in args.inputs:
        doc = json.loads(Path(path).read_text())
        errors = validate(doc)
        if errors:
            print(f"{path}: does not match the schema: {errors[0]}", file=sys.stderr)
            return 1
        docs.append(doc)
    data = rows(docs)
    print(table(data, args.markdown))
    return 1 if any(r["same_ids"] is False for r in data) else 0


if __name__ == "__main__":
    sys.exit(main())
