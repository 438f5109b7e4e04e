"""`python -m loadtests {run,compare,plot,suite}`: the load generator's command line.

    # sweep concurrency against any OpenAI-compatible server (ours, vllm serve, mlx_lm.server)
    python -m loadtests run --url http://127.0.0.1:8000 --workload copy --concurrency 1,2,4,8,16,32
    # Poisson arrivals instead, bounded by request count and time
    python -m loadtests run --url http://127.0.0.1:8000 --qps 0.5,1,2 --num-requests 40 --duration 60
    # start two servers on loopback, same workload interleaved, print B/A ratios
    python -m loadtests compare --a "specserve serve" --b "specserve serve --speculative-config '{...}'"
    # overlay earlier runs on one plot (speculation on vs off)
    python -m loadtests plot off.json ngram.json -o results/tmp/overlay.png
    # the results of docs/load-tests.md (see suite.py)
    python -m loadtests suite [--quick] [--update-docs]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtests import plots, report
from loadtests.matrix import MatrixConfig, ratios, run_matrix, started
from loadtests.runner import Level
from loadtests.servers import ServerProcess, ServerSpec
from loadtests.workloads import WORKLOADS

DEFAULT_OUT = Path("results/tmp/loadtests")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_load_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--workload", default="chat",
                   help=f"comma-separated, from {', '.join(WORKLOADS)} (default: chat)")
    g.add_argument("--concurrency", default="1,2,4,8,16,32",
                   help="fixed-concurrency sweep (default: %(default)s)")
    g.add_argument("--qps", default=None,
                   help="Poisson arrival rates instead of a concurrency sweep, e.g. 0.5,1,2")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests with --qps")
    g.add_argument("--num-requests", type=int, default=None,
                   help="requests per level (default: 2 x concurrency, at least 4; with --qps, qps x "
                        "duration)")
    g.add_argument("--duration", type=float, default=60.0, help="seconds per level: no new request after "
                   "this (default: %(default)s)")
    g.add_argument("--rounds", type=int, default=1, help="measure each level this many times, interleaved")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM / specserve extension)")
    g.add_argument("--greedy-fraction", type=float, default=0.5, help="mixed-temp: share of requests at T=0")
    g.add_argument("--warmup", type=int, default=2, help="unmeasured requests per server and workload")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--extra-body", default=None, help="JSON merged into every request body")


def matrix_config(args: argparse.Namespace) -> MatrixConfig:
    if args.qps:
        levels = [Level(qps=q, max_concurrency=args.max_concurrency) for q in _floats(args.qps)]
    else:
        levels = [Level(concurrency=int(c)) for c in _floats(args.concurrency)]
    workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r} (one of {', '.join(WORKLOADS)})")
    cfg = MatrixConfig(workloads=workloads, levels=levels, max_tokens=args.max_tokens, endpoint=args.endpoint,
                       ignore_eos=args.ignore_eos, duration_s=args.duration, rounds=args.rounds,
                       warmup=args.warmup, seed=args.seed, greedy_fraction=args.greedy_fraction,
                       extra_body=json.loads(args.extra_body) if args.extra_body else {})
    if args.num_requests:
        cfg.requests_per_slot, cfg.min_requests, cfg.max_requests = 0, args.num_requests, args.num_requests
    return cfg


def emit(kind: str, cfg: MatrixConfig, runs: list[dict[str, Any]], json_path: Path, png_path: Path,
         extra: dict[str, Any] | None = None, title: str = "") -> dict[str, Any]:
    """Print the table, write the JSON and one PNG per workload; return the document."""
    print()
    print(report.format_table(report.flat_levels(runs), report.level_columns()))
    doc = report.result_document(kind, cfg.to_json(), runs, extra)
    report.write_json(doc, json_path)
    if len(cfg.workloads) == 1:
        pngs = [plots.plot_runs(runs, png_path, title=title or f"workload: {cfg.workloads[0]}")]
    else:
        pngs = plots.plot_by_workload(runs, png_path.parent, prefix=png_path.stem + "-", title=title)
    print(f"\nwrote {json_path} and {', '.join(str(p) for p in pngs)}")
    return doc


def cmd_run(args: argparse.Namespace) -> int:
    cfg = matrix_config(args)
    label = args.label or args.url
    spec = ServerSpec(label=label, url=args.url.rstrip("/"), model=args.model)
    srv = ServerProcess(spec, Path("/dev/null"))  # not started by us: no log
    runs = run_matrix([srv], cfg)
    emit("run", cfg, runs, Path(args.output_json), Path(args.plot), {"url": args.url})
    completed = sum(lvl["completed"] for run in runs for lvl in run["levels"])
    return 0 if completed else 1  # nothing served at all: a wrong URL or a dead server


def print_ratios(rows: list[dict[str, Any]], base: str, other: str) -> None:
    cols: list[report.Column] = [("workload", lambda r: r["workload"]), ("level", lambda r: r["level"])]
    for key, head in (("output_throughput_tok_s", "tok/s"), ("ttft_s_p50", "TTFT p50"),
                      ("ttft_s_p99", "TTFT p99"), ("tpot_s_p50", "TPOT p50"), ("tpot_s_p99", "TPOT p99"),
                      ("e2e_s_p50", "e2e p50"), ("e2e_s_p99", "e2e p99")):
        cols.append((head, lambda r, k=key: "-" if r[k] is None else f"{r[k]:.2f}x"))
    print(f"\nratios {other} / {base} (tok/s above 1 is better; latencies below 1 are better):")
    print(report.format_table(rows, cols))


def cmd_compare(args: argparse.Namespace) -> int:
    cfg = matrix_config(args)
    cfg.rounds = max(cfg.rounds, 2)  # interleaving needs at least A B, B A
    out = Path(args.output_dir)
    specs = [ServerSpec(label=args.label_a, command=_split(args.a), model=args.model),
             ServerSpec(label=args.label_b, command=_split(args.b), model=args.model)]
    with started(specs, out / "logs") as (up, down):
        if down:
            for d in down:
                print(f"{d['label']} did not start: {d['error']}", file=sys.stderr)
            return 2
        runs = run_matrix(up, cfg)
    rows = ratios(runs, args.label_a, args.label_b)
    emit("compare", cfg, runs, out / "compare.json", out / "compare.png",
         {"ratios": {"base": args.label_a, "other": args.label_b, "rows": rows}},
         title=f"{args.label_b} vs {args.label_a}")
    print_ratios(rows, args.label_a, args.label_b)
    return 0


def _split(cmd: str) -> list[str]:
    from loadtests.servers import split_command

    return split_command(cmd)


def cmd_plot(args: argparse.Namespace) -> int:
    runs = []
    for path in args.inputs:
        doc = report.load_json(path)
        for run in doc["runs"]:
            runs.append({**run, "label": run["label"] if len(args.inputs) == 1 or args.keep_labels
                         else f"{run['label']} ({Path(path).stem})"})
    out = Path(args.output)
    if len({r["workload"] for r in runs}) == 1:
        print(plots.plot_runs(runs, out, title=f"workload: {runs[0]['workload']}"))
    else:
        for p in plots.plot_by_workload(runs, out.parent, prefix=out.stem + "-"):
            print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="drive one running server")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="request 'model' field (default: leave it out)")
    p.add_argument("--label", default=None)
    p.add_argument("--output-json", default=str(DEFAULT_OUT / "run.json"))
    p.add_argument("--plot", default=str(DEFAULT_OUT / "run.png"), help="PNG path")
    add_load_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="start two server command lines on loopback and compare them")
    p.add_argument("--a", required=True, help="baseline server command line ({port} optional)")
    p.add_argument("--b", required=True, help="other server command line")
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument("--model", default=None, help="request 'model' field (default: leave it out)")
    p.add_argument("--output-dir", default=str(DEFAULT_OUT / "compare"))
    add_load_options(p)
    p.set_defaults(func=cmd_compare, concurrency="1,4,16")

    p = sub.add_parser("plot", help="overlay the runs of result JSON files on one plot per workload")
    p.add_argument("inputs", nargs="+")
    p.add_argument("-o", "--output", default=str(DEFAULT_OUT / "overlay.png"))
    p.add_argument("--keep-labels", action="store_true", help="do not append the file name to labels")
    p.set_defaults(func=cmd_plot)

    from loadtests import adaptive, suite

    suite.add_parser(sub)
    adaptive.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
