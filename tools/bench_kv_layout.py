"""KV cache layout A/B through the real engine: `python -m tools.bench_kv_layout`.

Block-major (`[slots, Hkv, D]`, what the Metal kernels read) against head-major (`[Hkv, slots, D]`, the
CPU default) on the same model object, greedy with `ignore_eos` so both do identical work, at each
concurrency level, layouts alternating which goes first per repeat. Prints a table (tok/s per layout and
the ratio head / block) and writes JSON; fails if the two layouts' token ids differ.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import engine  # noqa: F401 - BLAS set-up before mlx
from engine.llm import LLM, chat_prompt_ids
from engine.models.loader import load_model
from engine.sampling import SamplingParams
from tools.bench_engine import PROMPTS
from tools.bench_spec import COPY_PROMPTS

LAYOUTS = ("block", "head")


def run(loaded: Any, layout: str, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    os.environ["SPECSERVE_KV_LAYOUT"] = layout  # read when the engine builds its cache
    try:
        llm = LLM(loaded=loaded, kv_cache_memory="1GiB", max_model_len=2048, show_progress=False,
                  max_num_seqs=max(len(prompts), 1))
    finally:
        os.environ.pop("SPECSERVE_KV_LAYOUT", None)
    assert llm.core.kv_cache.head_major == (layout == "head")
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(ids, sp)
    elapsed = time.perf_counter() - t0
    return elapsed, [o.token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output-json", default="results/bench_kv_layout.json")
    args = ap.parse_args(argv)
    loaded = load_model(None, dtype="float32", progress=False)
    pool = PROMPTS + COPY_PROMPTS
    rows: list[dict[str, Any]] = []
    identical = True
    for c in [int(x) for x in args.concurrency.split(",")]:
        prompts = [pool[i % len(pool)] for i in range(c)]
        secs: dict[str, list[float]] = {lay: [] for lay in LAYOUTS}
        ids: dict[str, list[list[int]]] = {}
        for r in range(args.repeats):
            for lay in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
                s, toks = run(loaded, lay, prompts, args.max_tokens)
                secs[lay].append(s)
                identical &= ids.setdefault(lay, toks) == toks
        identical &= ids["block"] == ids["head"]
        n = c * args.max_tokens
        tps = {lay: n / statistics.median(v) for lay, v in secs.items()}
        rows.append({"concurrency": c, "tokens": n, "seconds": secs, "tok_s": tps,
                     "head_vs_block": tps["head"] / tps["block"]})
        print(f"c={c:3d}: block {tps['block']:6.1f} tok/s  head {tps['head']:6.1f} tok/s  "
              f"head/block {tps['head'] / tps['block']:.2f}", flush=True)
    out = {"benchmark": "kv_layout", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
           "max_tokens": args.max_tokens, "repeats": args.repeats, "identical_token_ids": identical,
           "rows": rows}
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"token ids identical across layouts: {identical}; wrote {args.output_json}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
