"""What one call of the sampler costs, by rows and sampling parameters, on the default model's vocabulary.

    python -m tools.bench_sampler [--vocab 49152] [--repeats 20] [--output-json results/tmp/sampler.json]

A verification step samples one row per verified position, so this is the sampler's share of a step
that verifies K drafts (K + 1 rows). Random logits (scale 3); medians over --repeats calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from engine import platform

CASES: list[tuple[str, dict[str, Any]]] = [
    ("greedy", {"temperature": 0.0}),
    ("temperature 0.7", {"temperature": 0.7}),
    ("temperature 0.7, seeded", {"temperature": 0.7, "seed": 1}),
    ("temperature 0.7, top_p 0.9", {"temperature": 0.7, "top_p": 0.9}),
    ("temperature 1.0, top_k 50, penalty", {"temperature": 1.0, "top_k": 50, "presence_penalty": 0.5}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="1,5", help="comma-separated row counts (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    platform.setup()
    import mlx.core as mx

    from engine.sampler import sample
    from engine.sampling import RowState, SamplingParams

    counts = [int(r) for r in args.rows.split(",")]
    logits = mx.random.normal((max(counts), args.vocab), key=mx.random.key(0)) * 3
    mx.eval(logits)
    results = []
    print("| rows | parameters | ms per call |\n|---:|---|---:|")
    for n in counts:
        for name, kw in CASES:
            params = SamplingParams(**kw)
            rows = [RowState(params=params, output_token_ids=list(range(50 + i)),
                             prompt_token_ids=list(range(100)), eos_token_ids=[2]) for i in range(n)]
            x = logits[:n]
            sample(x, rows)  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                sample(x, rows)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            results.append({"rows": n, "parameters": name, "ms": ms})
            print(f"| {n} | {name} | {ms:.2f} |")
    if args.output_json:
        out = Path(args.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"vocab": args.vocab, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
