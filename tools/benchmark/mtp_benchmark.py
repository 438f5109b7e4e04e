"""Single-stream greedy benchmark of MTP assistants on held-out chat prompts (table + JSON).

    python -m tools.benchmark.mtp_benchmark --assistant configs/assistants/smollm2-135m-mtp \
        --k 1,3 --num-prompts 8 --max-tokens 64 --output-json results/mtp/smollm2.json

Variants (no speculation, MTP with each K, optionally a draft model) share one loaded target and run
interleaved prompt by prompt, one request at a time, so machine load hits them alike. Per-position
acceptance is counted from the engine's stats (`spec_benchmark.run_batch`); greedy token ids must be
identical across variants (checked).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--assistant", default=str(ROOT / "configs" / "assistants" / "smollm2-135m-mtp"))
    p.add_argument("--k", default="1,3", help="comma-separated num_speculative_tokens values")
    p.add_argument("--draft-model", default=None, help="also run method draft_model with this model")
    p.add_argument("--prompts", default=str(ROOT / "configs" / "train_prompts_heldout.jsonl"))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    import engine  # noqa: F401 - MKL before mlx
    from engine.llm import LLM
    from engine.models.loader import load_model
    from engine.sampling import SamplingParams
    from tools.benchmark.spec_benchmark import run_batch

    target = load_model(None, dtype="float32", progress=False)
    kw: dict[str, Any] = dict(kv_cache_memory="512MiB", max_model_len=2048, show_progress=False)
    variants: dict[str, Any] = {"baseline": LLM(loaded=target, **kw)}
    for k in [int(x) for x in args.k.split(",") if x]:
        cfg = {"method": "mtp", "model": args.assistant, "num_speculative_tokens": k}
        variants[f"mtp-k{k}"] = LLM(loaded=target, speculative_config=cfg, **kw)
    if args.draft_model:
        cfg = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": 3}
        variants["draft_model-k3"] = LLM(loaded=target, speculative_config=cfg, **kw)
    lines = Path(args.prompts).read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    texts = texts[: args.num_prompts]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm0 = variants["baseline"]
    prompts = [llm0.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    for name, llm in variants.items():  # warm-up (compiles, allocates)
        run_batch(llm, [prompts[0]], SamplingParams(max_tokens=8, temperature=0.0), f"warm-{name}")
    res: dict[str, dict[str, Any]] = {n: {"elapsed_s": 0.0, "tokens": 0, "drafts": 0, "draft_tokens": 0,
                                          "accepted_per_position": [], "token_ids": []} for n in variants}
    for i, prompt in enumerate(prompts):
        for name, llm in variants.items():
            out = run_batch(llm, [prompt], greedy, f"{name}-{i}")
            r = res[name]
            r["elapsed_s"] += out["elapsed_s"]
            r["tokens"] += out["output_tokens"]
            r["token_ids"].append(out["token_ids"][0])
            if out["spec"]:
                r["drafts"] += out["spec"]["num_drafts"]
                r["draft_tokens"] += out["spec"]["num_draft_tokens"]
                pp = out["spec"]["accepted_per_position"]
                acc = r["accepted_per_position"]
                acc.extend([0] * (len(pp) - len(acc)))
                for j, n in enumerate(pp):
                    acc[j] += n
    base = res["baseline"]
    rows = []
    for name, r in res.items():
        tps = r["tokens"] / r["elapsed_s"]
        per_pos = [n / r["drafts"] for n in r["accepted_per_position"]] if r["drafts"] else []
        rows.append({"variant": name, "output_tokens": r["tokens"], "elapsed_s": round(r["elapsed_s"], 3),
                     "tokens_per_s": round(tps, 2),
                     "speedup": round(tps / (base["tokens"] / base["elapsed_s"]), 3),
                     "drafts": r["drafts"], "draft_tokens": r["draft_tokens"],
                     "accepted_per_position": r["accepted_per_position"],
                     "acceptance_per_position": [round(x, 3) for x in per_pos],
                     "greedy_identical_to_baseline": r["token_ids"] == base["token_ids"]})
    print(f"{'variant':<16}{'tok/s':>8}{'speedup':>9}{'drafts':>8}  acceptance per position  identical")
    for row in rows:
        acc = ", ".join(f"{x:.2f}" for x in row["acceptance_per_position"]) or "-"
        print(f"{row['variant']:<16}{row['tokens_per_s']:>8.2f}{row['speedup']:>8.2f}x{row['drafts']:>8}  "
              f"[{acc}]  {row['greedy_identical_to_baseline']}")
    doc = {"benchmark": "specserve.mtp_benchmark", "command": [sys.executable, "-m",
                                                             "tools.benchmark.mtp_benchmark", *sys.argv[1:]],
           "assistant": args.assistant, "prompts": texts, "max_tokens": args.max_tokens, "results": rows}
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r["greedy_identical_to_baseline"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
