"""Speculative decoding benchmark: modes interleaved in one process, ratios against no speculation.

    python -m tools.bench_spec [--repeats 2] [--max-tokens 128] [--output-json results/bench_spec.json]

Workloads (greedy, default model, float32):
  copy      single stream, prompts that repeat or lightly edit a given text
  free      single stream, open chat questions
  repeated  single stream, a prompt set whose second half repeats the first (suffix's global cache)
  batch8    8 concurrent chat + copy requests, aggregate tokens/s (one closed batch: its end is the
            slowest request's)
  conc8     24 chat + copy requests, 8 in flight (max_num_seqs=8: a new one starts as one ends, as with a
            load generator at concurrency 8), aggregate tokens/s
Every run gets a fresh engine (same loaded weights) so no proposer state leaks between runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import engine
from engine.blas import blas_info
from engine.llm import LLM, chat_prompt_ids
from engine.models.loader import load_model
from engine.sampling import SamplingParams

COPY_TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank. A small bird sings on the old oak "
    "tree while the farmer walks to the market with a basket of red apples and a loaf of fresh bread. "
    "In the afternoon the children play football in the field behind the school, and their parents "
    "watch from the benches. When the sun goes down, everyone returns home for dinner, and the village "
    "becomes quiet again until the next morning.",
    "def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n\n\ndef multiply(a, b):\n"
    "    return a * b\n\n\ndef divide(a, b):\n    if b == 0:\n        raise ValueError('division by zero')\n"
    "    return a / b\n\n\ndef power(a, b):\n    return a ** b\n",
    "Dear team, the meeting on Monday is moved to Tuesday at ten in the morning. Please bring your "
    "reports and the budget figures for the third quarter. Lunch will be served after the meeting. "
    "If you cannot attend, send your report to the office manager before Monday evening, and we will "
    "discuss it without you. Thank you for your hard work this year. Best regards, the management.",
]
COPY_PROMPTS = [f"Repeat the following text exactly, word for word:\n\n{t}" for t in COPY_TEXTS]
FREE_PROMPTS = [
    "What are the main causes of climate change?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works.",
    "Give me three tips for learning a new language.",
]
MODES: dict[str, dict[str, Any] | None] = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "draft_model(self)": {"method": "draft_model", "model": "<target>", "num_speculative_tokens": 3},
    # The adaptive controller (#8) with ngram's lookup and at most ngram's K: what a user under load runs.
    "ngram(auto)": {"method": "ngram", "num_speculative_tokens": "auto", "prompt_lookup_min": 2,
                    "prompt_lookup_max": 5, "adaptive": {"max_num_speculative_tokens": 4}},
}


def run_once(loaded: Any, mode: str, prompts: list[list[int]], concurrent: bool, max_tokens: int,
             max_num_seqs: int = 256) -> dict:
    cfg = MODES[mode]
    if cfg is not None and cfg.get("model") == "<target>":
        cfg = {**cfg, "model": loaded.path}
    llm = LLM(loaded=loaded, kv_cache_memory="1GiB", max_model_len=2048, show_progress=False,
              speculative_config=cfg, max_num_seqs=max_num_seqs)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    # Decode steps by how many requests they carried: [steps, seconds]. In a closed batch the elapsed
    # time is the longest request's steps, each priced by what the batch computes in it.
    by_rows: dict[int, list[float]] = {}
    core_step = llm.core.step

    def step() -> Any:
        t = time.perf_counter()
        res = core_step()
        st = res[1]
        if st is not None and st.num_prompt_tokens == 0:
            acc = by_rows.setdefault(st.num_scheduled_requests, [0, 0.0])
            acc[0] += 1
            acc[1] += time.perf_counter() - t
        return res

    llm.core.step = step  # type: ignore[method-assign]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp) if concurrent else [llm.generate([p], sp)[0] for p in prompts]
    elapsed = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    # Decode rate: tokens after the first over the time after the first token (prefill excluded).
    if concurrent:
        decode_s = max(o.e2e_latency for o in outs) - min(o.time_to_first_token for o in outs)
    else:
        decode_s = sum(o.e2e_latency - o.time_to_first_token for o in outs)
    return {"tokens": n, "elapsed_s": elapsed, "tok_s": n / elapsed,
            "decode_tok_s": (n - len(outs)) / decode_s if decode_s > 0 else None,
            "draft_tokens": sum(o.spec_num_draft_tokens for o in outs),
            "accepted_tokens": sum(o.spec_num_accepted_tokens for o in outs),
            "drafts": sum(o.spec_num_drafts for o in outs),
            "decode_steps_by_requests": {n: by_rows[n] for n in sorted(by_rows, reverse=True)},
            "token_ids": [o.token_ids for o in outs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workloads", default="copy,free,repeated,batch8,conc8")
    ap.add_argument("--output-json", default="results/bench_spec.json")
    args = ap.parse_args(argv)

    loaded = load_model(None, dtype="float32", progress=False)
    tok = loaded.tokenizer

    def chat(text: str) -> list[int]:
        return chat_prompt_ids(tok, [{"role": "user", "content": text}])

    copy, free = [chat(t) for t in COPY_PROMPTS], [chat(t) for t in FREE_PROMPTS]
    batch8 = (free + copy + free)[:8]
    # (prompts, submitted together, most requests in flight)
    workloads = {
        "copy": (copy, False, 256), "free": (free, False, 256),
        "repeated": ((free[:2] + copy[:1]) * 2, False, 256), "batch8": (batch8, True, 256),
        "conc8": (batch8 * 3, True, 8)}
    modes = args.modes.split(",")
    chosen = args.workloads.split(",")

    warm = [chat("hi")]
    for m in modes:
        run_once(loaded, m, warm, False, 8)
    runs: dict[str, dict[str, list[dict]]] = {w: {m: [] for m in modes} for w in chosen}
    for rep in range(args.repeats):
        for w in chosen:
            prompts, concurrent, max_num_seqs = workloads[w]
            order = modes if rep % 2 == 0 else modes[::-1]  # alternate who goes first
            for m in order:
                r = run_once(loaded, m, prompts, concurrent, args.max_tokens, max_num_seqs)
                runs[w][m].append(r)
                print(f"[rep {rep}] {w:9s} {m:18s} {r['tok_s']:7.2f} tok/s  accepted "
                      f"{r['accepted_tokens']}/{r['draft_tokens']}", flush=True)

    summary: dict[str, dict[str, Any]] = {}
    print(f"\n{'workload':10s} {'mode':18s} {'tok/s':>8s} {'vs off':>7s} {'decode':>8s} {'vs off':>7s} "
          f"{'accept':>7s} {'mean len':>8s} exact")
    for w in chosen:
        base = statistics.median(r["tok_s"] for r in runs[w]["off"]) if "off" in modes else None
        base_dec = statistics.median(r["decode_tok_s"] for r in runs[w]["off"]) if "off" in modes else None
        ref_ids = runs[w]["off"][0]["token_ids"] if "off" in modes else None
        summary[w] = {}
        for m in modes:
            rs = runs[w][m]
            tps = statistics.median(r["tok_s"] for r in rs)
            dec = statistics.median(r["decode_tok_s"] for r in rs)
            drafted = sum(r["draft_tokens"] for r in rs)
            acc = sum(r["accepted_tokens"] for r in rs)
            drafts = sum(r["drafts"] for r in rs)
            exact = ref_ids is None or all(r["token_ids"] == ref_ids for r in rs)
            ratio = tps / base if base else None
            dec_ratio = dec / base_dec if base_dec else None
            summary[w][m] = {"tok_s": tps, "ratio_vs_off": ratio, "decode_tok_s": dec,
                             "decode_ratio_vs_off": dec_ratio, "acceptance_rate": acc / drafted if drafted
                             else None, "mean_acceptance_length": 1 + acc / drafts if drafts else None,
                             "greedy_identical": exact}
            rate = acc / drafted if drafted else 0.0
            mean_len = 1 + acc / drafts if drafts else 1.0
            print(f"{w:10s} {m:18s} {tps:8.2f} {ratio or 0:7.2f} {dec:8.2f} {dec_ratio or 0:7.2f} "
                  f"{rate:7.2f} {mean_len:8.2f} {exact}")

    for w in chosen:
        if not workloads[w][1]:
            continue
        print(f"\n{w}: decode steps by requests in the step, first run of each mode "
              "(requests: steps, mean ms)")
        for m in modes:
            steps = runs[w][m][0]["decode_steps_by_requests"]
            cells = [f"{n}: {c}, {1000 * sec / c:.0f}" for n, (c, sec) in steps.items()]
            print(f"  {m:18s} " + "  ".join(cells))

    checks = {}
    if "off" in modes and "ngram" in modes:
        checks["ngram_copy_>=3x"] = summary.get("copy", {}).get("ngram", {}).get("ratio_vs_off")
        checks["ngram_free_>=0.95x"] = summary.get("free", {}).get("ngram", {}).get("ratio_vs_off")
        for w in ("copy", "free"):
            checks[f"ngram_{w}_decode_ratio"] = summary.get(w, {}).get("ngram", {}).get("decode_ratio_vs_off")
    if "suffix" in modes and "ngram" in modes and "repeated" in summary:
        checks["suffix_over_ngram_repeated"] = (summary["repeated"]["suffix"]["tok_s"]
                                                / summary["repeated"]["ngram"]["tok_s"])
    for w in ("batch8", "conc8"):
        if w in summary and "off" in modes:
            checks[f"{w}_best_spec_vs_off"] = max(v["ratio_vs_off"] or 0 for k, v in summary[w].items()
                                                  if k != "off")
    print("\nchecks:", json.dumps(checks, indent=1))
    out = {"schema_version": 1, "timestamp": time.time(), "specserve": engine.__version__,
           "machine": {"platform": platform.platform(), "python": platform.python_version()},
           "blas": blas_info().name, "small_gemm": blas_info().small_gemm, "model": loaded.name,
           "model_path": loaded.path,
           "dtype": str(loaded.dtype),
           "max_tokens": args.max_tokens, "repeats": args.repeats, "modes": MODES, "summary": summary,
           "checks": checks, "runs": runs}
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
