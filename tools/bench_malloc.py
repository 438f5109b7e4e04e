"""glibc's default malloc vs engine/malloc.py's single arena and fixed thresholds, on real servers.

    python -m tools.bench_malloc [--servers-per-mode 2] [--concurrency 8,16,32]

Starts plain `specserve serve` servers (no speculation), half with `SPECSERVE_MALLOC=default` and half
with engine/malloc.py's single arena and fixed thresholds, drives them interleaved with the load tests'
copy and mixed-temperature workloads (`loadtests.matrix`, which reads each server's minor page faults
from /proc around each of its levels). Whether a default process falls into arena heap churn, and
when, is chance, so several servers per mode are run. Prints a table, writes
results/bench_malloc.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from loadtests import report
from loadtests.matrix import MatrixConfig, run_matrix, started
from loadtests.runner import Level
from loadtests.servers import ServerSpec, specserve_command


def rows_of(runs: list[dict[str, Any]], modes: dict[str, str]) -> list[dict[str, Any]]:
    """One row per server, workload and level from `run_matrix`'s runs (which read the page faults)."""
    rows = []
    for run in runs:
        for lvl in run["levels"]:
            faults = lvl["server_minor_faults"]
            assert faults is not None, "needs Linux /proc"
            rows.append({"server": run["label"], "mode": modes[run["label"]], "workload": run["workload"],
                         "level": lvl["level"], "tok_s": lvl["output_throughput_tok_s"],
                         "tpot_p50_s": lvl["tpot_s"]["p50"], "duration_s": lvl["duration_s"],
                         "minor_faults": faults, "faults_per_s": faults / lvl["duration_s"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    labels = sorted({r["server"] for r in rows})
    out = ["| workload | level | " + " | ".join(labels) + " |"]
    out.append("|---|---|" + "---:|" * len(labels))
    keys = list(dict.fromkeys((r["workload"], r["level"]) for r in rows))
    by = {(r["workload"], r["level"], r["server"]): r for r in rows}
    for wl, lvl in keys:
        cells = [f"{by[(wl, lvl, s)]['tok_s']:.1f} tok/s, {by[(wl, lvl, s)]['minor_faults'] / 1e6:.2f} M"
                 for s in labels]
        out.append(f"| {wl} | {lvl} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers-per-mode", type=int, default=2)
    ap.add_argument("--concurrency", default="8,16,32")
    ap.add_argument("--workloads", default="copy,mixed-temp")
    ap.add_argument("--output", default="results/bench_malloc.json")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    specs = []
    for i in range(args.servers_per_mode):
        for mode in ("default", "tuned"):
            specs.append(ServerSpec(label=f"{mode}-{i + 1}", command=specserve_command(None),
                                    env={"SPECSERVE_MALLOC": mode}, notes={"malloc": mode}))
    cfg = MatrixConfig(workloads=args.workloads.split(","),
                       levels=[Level(concurrency=int(c)) for c in args.concurrency.split(",")],
                       requests_per_slot=1, warmup=1)
    out = Path(args.output)
    with started(specs, out.parent / "bench_malloc_logs") as (up, down):
        if down:
            print(json.dumps(down), file=sys.stderr)
            return 1
        rows = rows_of(run_matrix(up, cfg), {spec.label: spec.notes["malloc"] for spec in specs})
    md = table(rows)
    print(md)
    doc = {"kind": "bench_malloc", "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "wall_s": time.monotonic() - t0, "environment": report.environment(), "config": cfg.to_json(),
           "command": " ".join(["python -m tools.bench_malloc", *sys.argv[1:]]), "rows": rows, "table": md}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps({"wrote": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
