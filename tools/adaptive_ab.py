"""Server-level A/B of two adaptive controllers: `off`, one static K, `auto` from this checkout and `auto`
from another source tree (a git worktree of the candidate branch), all up at once and interleaved.

    git worktree add /tmp/candidate my-branch
    python -m tools.adaptive_ab --candidate-tree /tmp/candidate --method ngram --static-k 4 \
        --concurrency 16,32 --workloads copy,mixed-temp --rounds 2 --output-dir results/tmp/adaptive-ab

The candidate server runs with PYTHONPATH set to its tree, so its `engine` package is imported from there.
Prints a table with each round's ratio (the machine's speed drifts between rounds, a ratio within one does
not) and writes `ab.json` (the load tests' result format, without per-request records) to the output
folder. Never run it beside other CPU-heavy work: oversubscribed BLAS threads slow one server by 10x,
not 2x.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import engine  # noqa: F401 - before any MLX import, as everywhere
from loadtests import report
from loadtests.adaptive import config, method_configs
from loadtests.matrix import run_matrix, started
from loadtests.servers import ServerSpec, default_model_folder, specserve_command

REPO = Path(__file__).resolve().parents[1]


def table(runs: list[dict[str, Any]], labels: list[str], static: str) -> list[str]:
    by = {(r["label"], r["workload"]): r for r in runs}
    lines = ["| workload | conc | " + " | ".join(labels) + " | main / max(off, static) | candidate / "
             "max(off, static) | candidate / main, per round |", "|---|---:|" + "---:|" * (len(labels) + 3)]
    for wl in sorted({r["workload"] for r in runs}):
        for i, lvl in enumerate(by[("off", wl)]["levels"]):
            t = {lab: by[(lab, wl)]["levels"][i] for lab in labels}
            tput = {lab: lv["output_throughput_tok_s"] or 0.0 for lab, lv in t.items()}
            best = max(tput["off"], tput[static]) or 1.0
            rounds = zip(t["auto (candidate)"].get("round_throughput_tok_s", []),
                         t["auto (main)"].get("round_throughput_tok_s", []), strict=False)
            per = " ".join(f"{c / m:.2f}" for c, m in rounds if m)
            lines.append(f"| {wl} | {lvl['concurrency']} | " + " | ".join(f"{tput[x]:.1f}" for x in labels)
                         + f" | {tput['auto (main)'] / best:.2f} | {tput['auto (candidate)'] / best:.2f} | "
                         + (per or "-") + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidate-tree", required=True, help="source tree of the candidate controller")
    p.add_argument("--method", default="ngram", choices=["ngram", "suffix", "draft_model", "mtp"])
    p.add_argument("--mtp-model", default=None)
    p.add_argument("--static-k", type=int, default=4, choices=[1, 2, 4])
    p.add_argument("--concurrency", default="16,32")
    p.add_argument("--workloads", default="copy,mixed-temp")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output-dir", default="results/tmp/adaptive-ab")
    args = p.parse_args(argv)
    candidate = Path(args.candidate_tree).resolve()
    if not (candidate / "engine" / "spec" / "adaptive.py").exists():
        p.error(f"{candidate} is not a specserve source tree (no engine/spec/adaptive.py)")
    cfgs = method_configs(args.method, default_model_folder(), args.mtp_model)
    static = f"k={args.static_k}"
    auto = cfgs[f"{args.method} auto"]
    specs = [ServerSpec("off", specserve_command(None)),
             ServerSpec(static, specserve_command(cfgs[f"{args.method} {static}"])),
             ServerSpec("auto (main)", specserve_command(auto), env={"PYTHONPATH": str(REPO)}),
             ServerSpec("auto (candidate)", specserve_command(auto), env={"PYTHONPATH": str(candidate)})]
    cfg = config(False, [int(c) for c in args.concurrency.split(",")], args.workloads.split(","), args.rounds)
    out = Path(args.output_dir)
    with started(specs, out / "logs") as (up, down):
        if down:
            print(f"servers that did not start: {down}", file=sys.stderr)
            return 1
        runs = run_matrix(up, cfg)
    command = " ".join(["python -m tools.adaptive_ab", *sys.argv[1:]])
    doc = report.result_document("adaptive_ab", cfg.to_json(), runs, {"command": command})
    report.write_json(doc, out / "ab.json", keep_requests=False)
    print("\n".join(table(runs, [s.label for s in specs], static)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
