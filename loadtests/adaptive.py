"""Adaptive speculation vs static K, interleaved in one run (issue: "auto" must never lose).

    python -m loadtests adaptive                  # ngram and draft_model, copy + mixed-temp, c = 1, 8, 16, 32
    python -m loadtests adaptive --quick          # ngram only, copy + mixed-temp, c = 1 and 8

Per method: no speculation, static K = 1, 2, 4, and "auto" (the method's adaptive block), all started
at once and driven level by level in alternating order. Writes results/adaptive/adaptive.json,
results.md (the ratio auto / max(off, best static K) at every point, and auto's single-stream speedup
beside the best static one's) and one PNG per workload with every curve.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from loadtests import plots, report
from loadtests.matrix import MatrixConfig, run_matrix, started
from loadtests.runner import Level, sum_known
from loadtests.servers import DEFAULT_MTP_ASSISTANT, ServerSpec, default_model_folder, specserve_command

STATIC_KS = (1, 2, 4)


def method_configs(method: str, model_folder: str, mtp_model: str | None = None) -> dict[str, dict[str, Any]]:
    base: dict[str, Any] = {"method": method}
    if method == "ngram":
        base |= {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
    elif method == "draft_model":
        base |= {"model": model_folder}  # the target as its own draft: the expensive-draft case
    elif method == "mtp":
        base |= {"model": mtp_model or DEFAULT_MTP_ASSISTANT}
    out = {f"{method} k={k}": {**base, "num_speculative_tokens": k} for k in STATIC_KS}
    out[f"{method} auto"] = {**base, "num_speculative_tokens": "auto",
                             "adaptive": {"max_num_speculative_tokens": max(STATIC_KS)}}
    return out


def config(quick: bool, concurrency: list[int] | None = None,
           workloads: list[str] | None = None, rounds: int = 1, requests_per_slot: int = 1,
           duration_s: float | None = None) -> MatrixConfig:
    levels = [Level(concurrency=c) for c in (concurrency or ((1, 8) if quick else (1, 8, 16, 32)))]
    return MatrixConfig(workloads=workloads or ["copy", "mixed-temp"], levels=levels,
                        max_tokens=48 if quick else 64,
                        requests_per_slot=requests_per_slot, min_requests=3 if quick else 4,
                        duration_s=duration_s or (30 if quick else 60), warmup=1, rounds=rounds)


def summarize(runs: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """One row per (method, workload, level): off, best static K, auto and the ratios."""
    by = {(r["label"], r["workload"]): r for r in runs}
    rows = []
    for method in methods:
        for wl in sorted({r["workload"] for r in runs}):
            off = by.get(("off", wl))
            auto = by.get((f"{method} auto", wl))
            if off is None or auto is None:
                continue
            for i, lvl in enumerate(off["levels"]):
                def tput(label: str, i: int = i, wl: str = wl) -> float:
                    run = by.get((label, wl))
                    return (run["levels"][i]["output_throughput_tok_s"] or 0.0) if run else 0.0

                def per_round(label: str, i: int = i, wl: str = wl) -> list[float]:
                    run = by.get((label, wl))
                    level = run["levels"][i] if run else {}
                    return [x or 0.0 for x in level.get("round_throughput_tok_s", [])]

                statics = {k: tput(f"{method} k={k}") for k in STATIC_KS}
                best_k = max(statics, key=lambda k: statics[k])
                t_off, t_auto = tput("off"), tput(f"{method} auto")
                best = max(t_off, statics[best_k])
                # Per round, against the same K: the machine's speed drifts between rounds, a ratio
                # within one round does not (the spread says how far one round can be trusted).
                rounds = zip(per_round(f"{method} auto"), per_round("off"), per_round(f"{method} k={best_k}"),
                             strict=False)
                by_round = [a / max(o, s) if max(o, s) else None for a, o, s in rounds]
                rows.append({"method": method, "workload": wl, "concurrency": lvl["concurrency"],
                             "off": t_off, "best_static_k": best_k, "best_static": statics[best_k],
                             "auto": t_auto, "auto_vs_best": t_auto / best if best else None,
                             "auto_vs_off": t_auto / t_off if t_off else None,
                             "best_static_vs_off": statics[best_k] / t_off if t_off else None,
                             "auto_vs_best_rounds": by_round})
    return rows


def merge_replicates(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs of several adaptive.json files of one matrix (replicates, e.g. a second run later) as
    one: per server, workload and level, tokens and seconds add up (throughput = all tokens / all
    seconds), each replicate's throughput (each of its rounds) stays as a round of its own, and TPOT p99
    is the worst replicate's."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for doc in docs:
        for run in doc["runs"]:
            groups.setdefault((run["label"], run["workload"]), []).append(run)
    out = []
    for runs in groups.values():
        levels = []
        for lvl in runs[0]["levels"]:
            same = [x for r in runs for x in r["levels"] if x["level"] == lvl["level"]]
            tokens, seconds = sum(x["output_tokens"] for x in same), sum(x["duration_s"] for x in same)
            p99 = [x["tpot_s"]["p99"] for x in same if x["tpot_s"]["p99"] is not None]
            faults = [x.get("server_minor_faults") for x in same]
            levels.append({"level": lvl["level"], "concurrency": lvl["concurrency"], "qps": lvl.get("qps"),
                           "completed": sum(x.get("completed", 0) for x in same),
                           "output_tokens": tokens, "duration_s": seconds,
                           "output_throughput_tok_s": tokens / seconds if seconds else None,
                           "round_throughput_tok_s": [t for x in same for t in
                                                      x.get("round_throughput_tok_s")
                                                      or [x["output_throughput_tok_s"]]],
                           "tpot_s": {"p99": max(p99) if p99 else None},
                           "server_minor_faults": sum_known(faults)})
        out.append({**runs[0], "levels": levels})
    return out


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"Measured {meta['date']} ({meta['wall_s']:.0f} s, load average "
             f"{meta['load_average_start']:.1f} at the start); output tokens/s per level, all servers "
             "interleaved. Target: auto >= 0.98x max(off, best static K) everywhere.", "",
             "| method | workload | conc | off | best static K | best static | auto | auto / max(off, best) "
             "| auto / off | best static / off | auto / max(off, best), per round |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        rounds = " ".join(_f(x) for x in r.get("auto_vs_best_rounds") or [])
        lines.append(f"| {r['method']} | {r['workload']} | {r['concurrency']} | {r['off']:.1f} | "
                     f"{r['best_static_k']} | {r['best_static']:.1f} | {r['auto']:.1f} | "
                     f"{_f(r['auto_vs_best'])} | {_f(r['auto_vs_off'])} | {_f(r['best_static_vs_off'])} | "
                     f"{rounds or '-'} |")
    return "\n".join(lines) + "\n"


def _trace_flag(out: Path, label: str, args: argparse.Namespace) -> list[str]:
    """`--step-trace` for one server with --step-traces: logs/<label>.steps.jsonl, started afresh."""
    if not args.step_traces:
        return []
    path = out / "logs" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", label) + ".steps.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # the server appends
    return ["--step-trace", str(path)]


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def run_merge(args: argparse.Namespace) -> int:
    docs = [json.loads((Path(d) / "adaptive.json").read_text()) for d in args.merge]
    runs = merge_replicates(docs)
    autos = [r["label"] for r in runs if r["label"].endswith(" auto")]
    methods = list(dict.fromkeys(label.removesuffix(" auto") for label in autos))
    out = Path(args.output_dir or "results/tmp/adaptive-merged")
    meta = {"date": " + ".join(d.get("date", "?") for d in docs),
            "wall_s": sum(d.get("wall_s", 0) for d in docs),
            "load_average_start": max(d.get("load_average_start", 0) for d in docs),
            "command": " ".join(["python -m loadtests", *sys.argv[1:]]), "merged": list(args.merge)}
    rows = summarize(runs, methods)
    out.mkdir(parents=True, exist_ok=True)
    doc = report.result_document("adaptive", docs[0].get("config", {}), runs, {**meta, "summary": rows})
    report.write_json(doc, out / "adaptive.json", keep_requests=False)
    plots.plot_by_workload(runs, out, title="specserve: adaptive K vs static K (replicates pooled);")
    md = markdown(rows, meta)
    (out / "results.md").write_text(md)
    print(md)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return run_merge(args)
    t0, load = time.monotonic(), os.getloadavg()[0]
    folder = default_model_folder()
    default = ["ngram"] if args.quick else ["ngram", "draft_model"]
    methods = args.methods.split(",") if args.methods else default
    modes: dict[str, dict[str, Any] | None] = {"off": None}
    for m in methods:
        modes |= method_configs(m, folder, args.mtp_model)
    out = Path(args.output_dir or ("results/tmp/adaptive-quick" if args.quick else "results/adaptive"))
    specs = [ServerSpec(label=label, command=specserve_command(cfg, extra=_trace_flag(out, label, args)))
             for label, cfg in modes.items()]
    cfg = config(args.quick, [int(c) for c in args.concurrency.split(",")] if args.concurrency else None,
                 args.workloads.split(",") if args.workloads else None, args.rounds, args.requests_per_slot,
                 args.duration)
    # `timeout` and kill send SIGTERM: exit through `started`'s cleanup, or the servers outlive us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with started(specs, out / "logs") as (up, down):
        runs = run_matrix(up, cfg)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": time.monotonic() - t0,
            "load_average_start": load, "unavailable": down,
            "command": " ".join(["python -m loadtests", *sys.argv[1:]])}
    rows = summarize(runs, methods)
    doc = report.result_document("adaptive", cfg.to_json(), runs, {**meta, "summary": rows})
    report.write_json(doc, out / "adaptive.json", keep_requests=False)
    plots.plot_by_workload(runs, out, title="specserve: adaptive K vs static K;")
    md = markdown(rows, meta)
    (out / "results.md").write_text(md)
    print(md)
    print(json.dumps({"wrote": str(out)}))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("adaptive", help='"num_speculative_tokens": "auto" vs static K, interleaved',
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="ngram only, c = 1 and 8")
    p.add_argument("--methods", default=None, help="comma-separated: ngram,suffix,draft_model,mtp")
    p.add_argument("--mtp-model", default=None, help="MTP assistant checkpoint for --methods ...,mtp")
    p.add_argument("--concurrency", default=None, help="levels, e.g. 1,8,16,32 (quick: 1,8)")
    p.add_argument("--workloads", default=None, help="comma-separated (default copy,mixed-temp)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each level this many times (other prompts each round, order alternating); "
                        "one round of 4 requests at c = 1 moves +-15%% between identical servers")
    p.add_argument("--requests-per-slot", type=int, default=1,
                   help="requests each client sends in turn per level (default 1: one wave, whose wall runs "
                        "to its last completion; more: sustained load, a finished request's slot refilled)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds per level after which no client starts a request (default 60, quick 30). "
                        "With --requests-per-slot > 1 a long one makes every server do the same requests: at "
                        "60 s a second wave starts on a server only if its first ends in time, a cliff that "
                        "moved `off` between 33 and 57 requests at c = 32 from one run to the next")
    p.add_argument("--step-traces", action="store_true",
                   help="every server writes a per-step trace to OUTPUT/logs/<label>.steps.jsonl "
                        "(`python -m tools.step_trace` summarises them)")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="run nothing: pool the adaptive.json of these output dirs (replicate runs of one "
                        "matrix) into one table, each replicate a round, written to --output-dir")
    p.add_argument("--output-dir", default=None)
    p.set_defaults(func=run)
