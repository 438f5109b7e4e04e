"""What a decode/verify step costs at C requests for a given mix of per-request token counts.

    python -m tools.bench_verify_mix [--requests 32] [--repeats 5] [--output-json results/tmp/verify_mix.json]

C copy-workload requests are prefilled and decoded a few steps by the real engine; then the runner
executes hand-built steps in which request i recomputes its last n_i tokens (1: a decode row, n: a
row verifying n - 1 drafts; the KV slots are rewritten with the same values). Mixes alternate order
per repeat. Adaptive K gives requests different draft counts in one step, so what matters is whether
a mix costs what its tokens cost or what its longest row costs for every drafting row (the padded
attention before 8dcffcd). Prints median ms per step and ms per draft token over the all-1 mix.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from engine import platform as engine_platform


def mixes(c: int) -> dict[str, list[int]]:
    half = c // 2
    candidates = {
        f"{c} x 1": [1] * c,
        # Probes: one request (or a few) verifying one draft among decode rows.
        f"1 x 2 + {c - 1} x 1": [2] + [1] * (c - 1),
        f"{c // 8} x 2 + {c - c // 8} x 1": [2] * (c // 8) + [1] * (c - c // 8),
        f"{half} x 2 + {c - half} x 1": [2] * half + [1] * (c - half),
        f"{half - 1} x 2 + 1 x 5 + {c - half} x 1": [2] * (half - 1) + [5] + [1] * (c - half),
        f"{c} x 2": [2] * c,
        f"{c - 1} x 2 + 1 x 5": [2] * (c - 1) + [5],
        f"{c // 4} x 5 + {c - c // 4} x 2": [5] * (c // 4) + [2] * (c - c // 4),
        # Lookups at K = 4: the copying half verifies four drafts, the chatting half decodes.
        f"{half} x 5 + {c - half} x 1": [5] * half + [1] * (c - half),
        f"{c} x 5": [5] * c,
    }
    # Small C makes some mixes empty, short or repeats of another: keep each distinct full mix once.
    out: dict[str, list[int]] = {}
    for name, ns in candidates.items():
        if len(ns) == c and ns not in out.values():
            out[name] = ns
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-json", default="results/tmp/verify_mix.json")
    args = p.parse_args(argv)
    engine_platform.setup()  # the BLAS, malloc and OpenMP choices, before anything imports mlx

    import mlx.core as mx

    from engine.blas import blas_info
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.llm import chat_prompt_ids
    from engine.models.loader import load_model
    from engine.sampling import SamplingParams
    from engine.step import ScheduledRequest, SchedulerOutput
    from loadtests.datasets import load_dataset

    c = args.requests
    loaded = load_model(None, "auto", None, None, progress=False)
    core = EngineCore(EngineConfig(max_model_len=2048, kv_cache_memory="512MiB", show_progress=False, seed=0),
                      loaded=loaded)
    items = load_dataset("copy")
    for i in range(c):
        core.add_request(f"r{i}", chat_prompt_ids(loaded.tokenizer, items[i % len(items)].messages),
                         SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    decode_steps = 0
    while decode_steps < 4:  # past the prefill, every request decoding
        _, st = core.step()
        if st is not None and st.num_prompt_tokens == 0 and st.num_scheduled_requests == c:
            decode_steps += 1
    reqs = list(core.scheduler.running)

    def scheduled(ns: list[int]) -> SchedulerOutput:
        out = SchedulerOutput()
        for r, n in zip(reqs, ns, strict=True):
            done = r.num_computed_tokens
            toks = list(r.all_token_ids[done - n : done])
            table = core.kv.block_table(r.request_id)
            out.scheduled.append(ScheduledRequest(r.request_id, toks, done - n, table, n, toks[1:], r.params,
                                                  r.prompt_token_ids, r.output_token_ids, []))
            out.num_batched_tokens += n
        return out

    variants = mixes(c)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(args.repeats + 1):  # the first pass warms every shape and is dropped
        order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
        for name in order:
            so = scheduled(variants[name])
            t0 = time.perf_counter()
            core.runner.execute(so)
            if rep > 0:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[f"{c} x 1"])
    rows: list[dict[str, Any]] = []
    print(f"{'mix':32s} {'tokens':>6s} {'ms/step':>8s} {'ms/draft':>9s}")
    for name, ns in variants.items():
        med = statistics.median(times[name])
        drafts = sum(ns) - c
        per = (med - base) / drafts * 1000 if drafts else None
        rows.append({"mix": name, "tokens": ns, "num_tokens": sum(ns), "median_s": med,
                     "seconds": times[name], "ms_per_draft_token": per})
        print(f"{name:32s} {sum(ns):6d} {med * 1000:8.1f} {per if per is not None else float('nan'):9.2f}")
    result = {"benchmark": "verify_mix", "requests": c, "repeats": args.repeats,
              "contexts": [r.num_tokens for r in reqs], "blas": blas_info().name,
              "mlx": mx.__version__, "python": platform.python_version(), "machine": platform.machine(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(result, indent=1))
    print(json.dumps({"wrote": args.output_json}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
