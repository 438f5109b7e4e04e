"""KV layout or attention backend A/B through the real engine: `specserve bench kv-layout
[--compare layout|attention]`.

`layout`: block-major (`[slots, Hkv, D]`, what the Metal kernels read) against head-major (`[Hkv, slots,
D]`, the CPU default), both on the MLX reference attention's gather; `attention`: the reference attention
(MLX ops) against the C kernel (engine/cpu/attention.c), both head-major. Same model object, greedy with
`ignore_eos` so both variants do identical work, at each concurrency level, variants alternating which
goes first per repeat. Prints tok/s per variant and the ratio second / first, and writes JSON. Fails if
the layouts' token ids differ (the same arithmetic); the two attention backends round their exponentials
differently, so there their agreement is only reported.
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

from loadtests.datasets import load_dataset
from loadtests.engine_bench import PROMPTS

# Per comparison: (variant names, KV layout of each, attention backend of each).
COMPARISONS = {"layout": (("block", "head"), ("block", "head"), ("reference", "reference")),
               "attention": (("reference", "cpu"), ("head", "head"), ("reference", "cpu"))}


def _generate(loaded: Any, layout: str, attention: str, prompts: list[str], max_tokens: int
              ) -> tuple[float, list[list[int]]]:
    from engine.llm import LLM, chat_prompt_ids
    from engine.sampling import SamplingParams

    llm = LLM(loaded=loaded, kv_cache_memory="1GiB", max_model_len=2048, show_progress=False,
              max_num_seqs=max(len(prompts), 1), attention_backend=attention, kv_layout=layout)
    assert llm.core.kv_cache.head_major == (layout == "head")
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(ids, sp)
    elapsed = time.perf_counter() - t0
    return elapsed, [o.token_ids for o in outs]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--compare", choices=sorted(COMPARISONS), default="layout")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output-json", default="results/bench_kv_layout.json")


def run(args: argparse.Namespace) -> int:
    from engine.models.loader import load_model

    loaded = load_model(None, dtype="float32", progress=False)
    names, layouts, backends = COMPARISONS[args.compare]
    first, second = names
    pool = PROMPTS + [it.prompt_text() for it in load_dataset("copy")[:3]]
    rows: list[dict[str, Any]] = []
    identical = True
    for c in [int(x) for x in args.concurrency.split(",")]:
        prompts = [pool[i % len(pool)] for i in range(c)]
        secs: dict[str, list[float]] = {v: [] for v in names}
        ids: dict[str, list[list[int]]] = {}
        for r in range(args.repeats):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                s, toks = _generate(loaded, layouts[i], backends[i], prompts, args.max_tokens)
                secs[names[i]].append(s)
                identical &= ids.setdefault(names[i], toks) == toks
        identical &= ids[first] == ids[second]
        n = c * args.max_tokens
        tps = {v: n / statistics.median(t) for v, t in secs.items()}
        rows.append({"concurrency": c, "tokens": n, "seconds": secs, "tok_s": tps,
                     f"{second}_vs_{first}": tps[second] / tps[first]})
        print(f"c={c:3d}: {first} {tps[first]:6.1f} tok/s  {second} {tps[second]:6.1f} tok/s  "
              f"{second}/{first} {tps[second] / tps[first]:.2f}", flush=True)
    out = {"benchmark": f"kv_{args.compare}" if args.compare == "layout" else "attention_backend",
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
           "variants": dict(zip(names, zip(layouts, backends, strict=True), strict=True)),
           "max_tokens": args.max_tokens, "repeats": args.repeats, "identical_token_ids": identical,
           "rows": rows}
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"token ids identical across {args.compare} variants: {identical}; wrote {args.output_json}")
    return 0 if identical or args.compare == "attention" else 1

