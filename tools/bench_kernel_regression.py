"""The C kernels and end-to-end decode of this tree against an earlier commit's, on this machine.

    python -m tools.bench_kernel_regression [--baseline 45dca55] [--repeats 3]
        [--output-json results/tmp/kernel-regression.json]

The baseline is checked out once as a git worktree (under the system temp folder) and runs with this
tree's virtual environment. Each variant runs in its own process (the kernels are chosen at import);
processes alternate order per repeat so every variant sees the same machine. Variants: the baseline,
this tree with float32 activations (the same arithmetic as the baseline: the no-regression check) and
this tree with 8-bit activations (`--activation-precision int8`). A process times: the 4-bit product
(`qgemm`) at the default model's weight shapes and 1-32 rows; the float32 small-M GEMM under MLX's matmul; one
engine step (decoder layers, attention, head) at 4 bits and float32 weights; and greedy decode of 128
tokens at 4 bits, one stream. Reported: medians per variant and each against the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Runs inside each tree, so it uses only what both the baseline and this tree provide.
CHILD = r"""
import json, statistics, sys, time
import engine  # no platform.setup() in either tree: the committed comparison ran without it
import mlx.core as mx
import numpy as np
from engine.cpu.qgemm import PackedWeights, qgemm_host
from engine.llm import LLM
from engine.models import adapter
from engine.models.loader import load_model
from engine.sampling import SamplingParams

iters, extra = int(sys.argv[1]), json.loads(sys.argv[2])
int8 = extra.pop("int8", False)
res = {}

def med(fn, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3

rng = np.random.default_rng(0)
for n, k in [(576, 576), (1536, 576), (576, 1536), (49152, 576)]:
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    pw = PackedWeights.affine(*mx.quantize(w, group_size=32, bits=4), group_size=32, bits=4)
    for m in (1, 5, 8, 32):
        x = rng.standard_normal((m, k)).astype(np.float32)
        kw = {"int8": True} if int8 else {}
        qgemm_host(x, pw, **kw)
        res[f"qgemm q4 {n}x{k} M={m}"] = med(lambda: qgemm_host(x, pw, **kw), 4 * iters)
for m in (1, 5, 8):
    a = mx.array(rng.standard_normal((m, 576)).astype(np.float32))
    b = mx.array(rng.standard_normal((576, 1536)).astype(np.float32))
    mx.eval(a @ b)
    res[f"small gemm f32 {m}x576x1536"] = med(lambda: mx.eval(a @ b), 4 * iters)

ctx, blocks = 200, 16
toks = [(i * 7919) % 40000 + 100 for i in range(ctx + 16)]
tables = [list(range(1 + r * blocks, 1 + (r + 1) * blocks)) for r in range(8)]
for dtype in (None, "float32"):
    kw = {} if dtype is None else {"dtype": dtype}
    args = {k: v for k, v in extra.items() if dtype is None or v != "int8"}  # float32 weights: no int8
    llm = LLM(loaded=load_model(None, progress=False, **kw), kv_cache_memory="1GiB", max_model_len=2048,
              show_progress=False, **args)
    runner = llm.core.runner
    for table in tables:
        mx.eval(runner.forward_chunks([(toks[:ctx], 0, table, 1)]))
    for r, t in [(1, 1), (1, 5), (8, 1), (8, 5)]:
        def step():
            chunks = [(toks[ctx + i : ctx + i + t], ctx, tables[i], t) for i in range(r)]
            mx.eval(mx.argmax(adapter.compute_logits(runner.model, runner.forward_chunks(chunks)), axis=-1))
        step()
        res[f"step {dtype or '4-bit'} {r}x{t}"] = med(step, iters)
    if dtype is None:
        p = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llm.generate("Write a short story about a lighthouse keeper.", p)
        rates = []
        for _ in range(2):
            t0 = time.perf_counter()
            out = llm.generate("Write a short story about a lighthouse keeper.", p)[0]
            rates.append(len(out.token_ids) / (time.perf_counter() - t0))
        res["decode 4-bit 1 stream (tok/s)"] = max(rates)
    del llm, runner
print(json.dumps(res))
"""


def _baseline_tree(ref: str) -> Path:
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True,
                         text=True, check=True).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"specserve-baseline-{sha}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha], check=True,
                       capture_output=True)
    return tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="45dca55", help="git ref of the kernels to compare against")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=15, help="timed calls per measurement per process")
    ap.add_argument("--output-json", default="results/tmp/kernel-regression.json")
    args = ap.parse_args(argv)
    base = _baseline_tree(args.baseline)
    variants: dict[str, tuple[Path, dict[str, Any]]] = {
        "baseline": (base, {}),
        "float32 act": (ROOT, {"activation_precision": "float32"}),
        "int8 act": (ROOT, {"int8": True, "activation_precision": "int8"}),
    }
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        for v in list(variants) if rep % 2 == 0 else list(variants)[::-1]:
            tree, extra = variants[v]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.iters), json.dumps(extra)],
                                 cwd=tree, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{v} failed:\n{out.stderr[-3000:]}")
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"[rep {rep}] {v} done", flush=True)
    keys = list(runs["baseline"][0])
    med = {v: {k: statistics.median(r[k] for r in runs[v]) for k in keys} for v in variants}
    # Speed for every row: baseline time / variant time, or variant rate / baseline rate.
    def ratio(v: str, k: str) -> float:
        a, b = med["baseline"][k], med[v][k]
        return b / a if k.endswith("(tok/s)") else a / b

    print("\n| measurement | baseline | float32 act | x baseline | int8 act | x baseline |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in keys:
        print(f"| {k} | {med['baseline'][k]:.3f} | {med['float32 act'][k]:.3f} | "
              f"{ratio('float32 act', k):.2f} | {med['int8 act'][k]:.3f} | {ratio('int8 act', k):.2f} |")
    print("(ms unless marked; x baseline > 1 is faster)")
    from engine.cpu.build import selected_isa

    out_path = Path(args.output_json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "timestamp": time.time(), "baseline": args.baseline, "isa": selected_isa(),
        "repeats": args.repeats, "iters": args.iters, "median": med,
        "speed_vs_baseline": {v: {k: ratio(v, k) for k in keys} for v in variants if v != "baseline"},
        "runs": runs}, indent=1) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
