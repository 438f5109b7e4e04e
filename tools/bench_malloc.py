"""glibc's adaptive malloc thresholds vs the fixed ones of engine/malloc.py, on real servers.

    python -m tools.bench_malloc [--servers-per-mode 2] [--concurrency 8,16,32]

Starts plain `specserve serve` servers (no speculation), half with `SPECSERVE_MALLOC=default` and half
with the fixed thresholds, drives them interleaved with the load tests' copy and mixed-temperature
workloads, and reads each server's minor page faults from /proc before and after each of its levels.
Whether a process with the default thresholds falls into the free-trim-refault cycle depends on its
allocation history, so several servers per mode are run. Prints a table, writes
results/bench_malloc.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from loadtests import report
from loadtests.client import RequestOptions
from loadtests.matrix import MatrixConfig, started
from loadtests.runner import Level, run_level, warm_up
from loadtests.servers import ServerProcess, ServerSpec, specserve_command
from loadtests.workloads import load_workload


async def drive(servers: list[ServerProcess], cfg: MatrixConfig) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    flip = 0
    for wl in cfg.workloads:
        items = load_workload(wl, seed=cfg.seed)
        opts = RequestOptions(endpoint=cfg.endpoint, max_tokens=cfg.max_tokens)
        for srv in servers:
            await warm_up(srv.url, items, RequestOptions(endpoint=cfg.endpoint, max_tokens=8), cfg.warmup)
        offset = 0
        for level in cfg.levels:
            n = cfg.num_requests(level)
            order = servers if flip % 2 == 0 else servers[::-1]
            flip += 1
            for srv in order:
                f0 = srv.minor_faults()
                res = await run_level(srv.url, items, opts, level, n, cfg.duration_s, offset=offset)
                f1 = srv.minor_faults()
                assert f0 is not None and f1 is not None, "needs Linux /proc"
                faults = f1 - f0
                row = {"server": srv.spec.label, "mode": srv.spec.notes["malloc"], "workload": wl,
                       "level": level.key, "tok_s": res["output_throughput_tok_s"],
                       "tpot_p50_s": res["tpot_s"]["p50"], "duration_s": res["duration_s"],
                       "minor_faults": faults, "faults_per_s": faults / res["duration_s"]}
                rows.append(row)
                print(f"  [{wl} {level.key}] {srv.spec.label:>10}: {row['tok_s']:6.1f} tok/s, "
                      f"{faults:>10,d} minor faults ({row['faults_per_s']:,.0f}/s)", flush=True)
            offset += n
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| workload | level | " + " | ".join(sorted({r['server'] for r in rows})) + " |"]
    labels = sorted({r["server"] for r in rows})
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
        rows = asyncio.run(drive(up, cfg))
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
