"""Small-M GEMM benchmark: one model step of T tokens with the kernel on and off (MKL alone).

    python -m tools.bench_small_gemm [--repeats 3] [--output-json results/bench_small_gemm.json]

The kernel is chosen when `engine` is imported, so each variant runs in its own process
(`SPECSERVE_SMALL_GEMM=on|off`); processes alternate order per repeat. A process times, at a 200-token
context, the forward pass of one request computing T tokens plus the head and argmax (T = 1: a
decode step; T = 5: verifying 4 drafts) and of T single-token requests in one batch. Reported: median
ms per step, and each step's cost relative to T = 1 of the same variant (what speculation pays).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import platform

# (requests, tokens each): one request decoding or verifying T-1 drafts; batches of decoding requests;
# batches where every request verifies drafts (12 to 40 rows: several chunks of rows per weight block).
SHAPES = [(1, 1), (1, 2), (1, 3), (1, 5), (1, 8), (4, 1), (8, 1), (4, 3), (8, 2), (8, 3), (8, 5)]


def label(requests: int, tokens: int) -> str:
    if requests == 1:
        return f"1 request T={tokens}"
    return f"batch T={requests}" if tokens == 1 else f"batch {requests}x{tokens}"


CONTEXT = 200  # tokens each request has in its cache before the timed steps


def prepared_step(runner: Any) -> Callable[[int, int], None]:
    """Up to 8 requests with a 200-token context each in `runner`'s cache; returns step(requests, tokens):
    the forward pass of that many requests computing that many tokens each, plus the head and argmax."""
    import mlx.core as mx

    from engine.models import adapter

    ctx, blocks = CONTEXT, 16
    toks = [(i * 7919) % 40000 + 100 for i in range(ctx + 16)]
    tables = [list(range(1 + r * blocks, 1 + (r + 1) * blocks)) for r in range(8)]
    for table in tables:
        mx.eval(runner.forward_chunks([(toks[:ctx], 0, table, 1)]))

    def step(requests: int, t: int) -> None:
        chunks = [(toks[ctx + r : ctx + r + t], ctx, tables[r], t) for r in range(requests)]
        h = runner.forward_chunks(chunks)
        mx.eval(mx.argmax(adapter.compute_logits(runner.model, h), axis=-1))

    return step


def measure(iters: int) -> dict[str, Any]:
    from engine.blas import blas_info
    from engine.llm import LLM
    from engine.models.loader import load_model

    llm = LLM(loaded=load_model(None, dtype="float32", progress=False), kv_cache_memory="1GiB",
              max_model_len=2048, show_progress=False)
    step = prepared_step(llm.core.runner)

    times: dict[str, list[float]] = {label(r, t): [] for r, t in SHAPES}
    for _ in range(iters):
        for r, t in SHAPES:
            t0 = time.perf_counter()
            step(r, t)
            times[label(r, t)].append(time.perf_counter() - t0)
    return {"small_gemm": blas_info().small_gemm, "blas": blas_info().name,
            "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=12, help="timed steps per shape per process")
    ap.add_argument("--output-json", default="results/bench_small_gemm.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    platform.setup()  # the BLAS, malloc and OpenMP choices, before anything imports mlx
    if args.child:
        print(json.dumps(measure(args.iters)))
        return 0

    variants = {"on": "on", "off": "off"}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        for v in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
            env = {**os.environ, "SPECSERVE_SMALL_GEMM": variants[v]}
            out = subprocess.run([sys.executable, "-m", "tools.bench_small_gemm", "--child",
                                  "--iters", str(args.iters)], env=env, capture_output=True, text=True,
                                 check=True)
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"[rep {rep}] {v}: {runs[v][-1]['small_gemm']}", flush=True)

    keys = list(runs["on"][0]["median_ms"])
    med = {v: {k: statistics.median(r["median_ms"][k] for r in runs[v]) for k in keys} for v in variants}
    print("\n| step | kernel off (ms) | kernel on (ms) | on / off | off vs T=1 | on vs T=1 |")
    print("|---|---|---|---|---|---|")
    base = "1 request T=1"
    for k in keys:
        off, on = med["off"][k], med["on"][k]
        print(f"| {k} | {off:.1f} | {on:.1f} | {on / off:.2f} | {off / med['off'][base]:.2f} | "
              f"{on / med['on'][base]:.2f} |")
    result = {"schema_version": 1, "timestamp": time.time(), "repeats": args.repeats, "iters": args.iters,
              "status": {v: runs[v][0]["small_gemm"] for v in variants}, "median_ms": med, "runs": runs}
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
