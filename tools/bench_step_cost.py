"""One engine step's cost by shape, per activation precision, at the weights' own precision.

    python -m tools.bench_step_cost [--precisions auto:float32,auto:int8] [--iters 30]
        [--output-json results/tmp/step-cost.json]

Each precision (WEIGHTS[:ACTIVATIONS], as `specserve bench offline --precisions` names them) gets its own
engine in this process; steps alternate between them shape by shape, so both see the same machine. A
step is the forward pass of R requests computing T tokens each at a 200-token context, plus the head and
argmax (1 request x T = 5: verifying 4 drafts). Reported: median ms per step, and each step's cost against
the same precision's 1-token step (what a verification row costs speculation), as a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from engine import platform

SHAPES = [(1, 1), (1, 2), (1, 3), (1, 5), (1, 8), (4, 1), (8, 1), (8, 5)]


def _engine(precision: str) -> Any:
    from engine.llm import LLM
    from engine.models.loader import load_model
    from loadtests.quality import engine_args, load_args

    loaded = load_model(None, progress=False, **load_args(precision))
    return LLM(loaded=loaded, kv_cache_memory="1GiB", max_model_len=2048, show_progress=False,
               **engine_args(precision))


def main(argv: list[str] | None = None) -> int:
    platform.setup()  # the BLAS, malloc and OpenMP choices, before anything imports mlx
    from engine.cpu.build import selected_isa
    from loadtests.quality import precision_list
    from tools.bench_small_gemm import CONTEXT, prepared_step

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", default="auto:float32,auto:int8")
    ap.add_argument("--iters", type=int, default=30, help="timed steps per shape and precision")
    ap.add_argument("--output-json", default="results/tmp/step-cost.json")
    args = ap.parse_args(argv)
    names = precision_list(args.precisions)
    steps = {p: prepared_step(_engine(p).core.runner) for p in names}
    times: dict[str, dict[str, list[float]]] = {p: {f"{r}x{t}": [] for r, t in SHAPES} for p in names}
    for i in range(args.iters):
        for r, t in SHAPES:
            for p in names if i % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                steps[p](r, t)
                times[p][f"{r}x{t}"].append(time.perf_counter() - t0)
    med = {p: {k: statistics.median(v) * 1e3 for k, v in d.items()} for p, d in times.items()}
    rel = {p: {k: v / m["1x1"] for k, v in m.items()} for p, m in med.items()}
    header = "| requests x tokens | " + " | ".join(f"{p} ms | x 1x1" for p in names) + " |"
    lines = [header, "|---|" + "---:|---:|" * len(names)]
    for r, t in SHAPES:
        k = f"{r}x{t}"
        lines.append(f"| {k} | " + " | ".join(f"{med[p][k]:.2f} | {rel[p][k]:.2f}" for p in names) + " |")
    if len(names) == 2:
        a, b = names
        lines.append("")
        lines.append(f"{b} against {a}, by shape: " + ", ".join(
            f"{k} {med[a][k] / med[b][k]:.2f}x" for k in med[a]))
    print("\n".join(lines))
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"isa": selected_isa(), "iters": args.iters, "context": CONTEXT,
                               "median_ms": med, "relative_to_1x1": rel}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
