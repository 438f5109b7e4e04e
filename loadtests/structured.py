"""`specserve bench structured`: what structured outputs cost and what speculation gives them, through the
engine in one process, variants interleaved round by round (ratios within a round).

- mask cost: the same JSON-asking chat prompts decoded free and under a JSON schema, `max_tokens` tokens each
  (`ignore_eos`, so both decode as many), 1 and `--concurrency` requests at a time: constrained / free
  tokens/s.
- extraction: invoices (generated, seeded) whose fields the schema asks for, so values are copied from the
  prompt; constrained greedy decoding plain and with ngram, with JSON's optional whitespace and without it
  (`disable_any_whitespace`: keys and separators are then forced, drafted for free): ngram / plain
  tokens/s, and the outputs compared token for token.

    specserve bench structured --rounds 3 --output results/structured/structured.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from loadtests.report import dumps

CHAT_ASKS = ["Describe a person called {n} as JSON.", "Give {n}'s profile in JSON.",
             "Write a JSON record for {n}.", "Return JSON about {n}, a customer."]
NAMES = ["Alice", "Bob", "Carol", "Dan", "Erin", "Frank", "Grace", "Heidi"]
PROFILE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
    "interests": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5}},
    "required": ["name", "age", "email", "city", "interests"], "additionalProperties": False}
INVOICE = {"type": "object", "properties": {
    "invoice_id": {"type": "string"}, "customer": {"type": "string"}, "address": {"type": "string"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "description": {"type": "string"}, "quantity": {"type": "integer"}},
        "required": ["sku", "description", "quantity"], "additionalProperties": False}}},
    "required": ["invoice_id", "customer", "address", "items"], "additionalProperties": False}
_GOODS = ["stainless steel kettle", "oak dining chair", "wool throw blanket", "ceramic coffee mug",
          "linen table runner", "cast iron skillet", "bamboo cutting board", "glass water carafe",
          "copper saucepan", "cotton bath towel", "walnut serving tray", "porcelain dinner plate"]
_STREETS = ["Crescent Road", "Mill Lane", "Harbour Street", "Station Avenue", "Orchard Close"]
_TOWNS = ["Bristol", "Leeds", "York"]
_PEOPLE = ["Margaret Holloway", "Tobias Lindqvist", "Priya Raman", "Oluwaseun Adeyemi", "Claire Dubois",
           "Henrik Vos", "Ana Ferreira", "Kenji Watanabe"]


def invoice(rng: random.Random) -> str:
    """A plain-text invoice of 4 to 7 lines."""
    lines = [f"SKU {rng.randint(10000, 99999)}-{rng.choice('ABCDEFGH')}  {good}  qty {rng.randint(1, 9)}"
             for good in rng.sample(_GOODS, rng.randint(4, 7))]
    return (f"INVOICE INV-{rng.randint(10000, 99999)}\nBill to: {rng.choice(_PEOPLE)}\n"
            f"Address: {rng.randint(1, 200)} {rng.choice(_STREETS)}, {rng.choice(_TOWNS)}\n"
            + "\n".join(lines) + "\nThank you for your order.")


def _measure(llm: Any, prompts: list[list[int]], params: Any, concurrency: int) -> dict[str, Any]:
    from loadtests.offline import run_batch

    tokens, seconds, outputs = 0, 0.0, []
    for start in range(0, len(prompts), concurrency):
        run = run_batch(llm, prompts[start:start + concurrency], params, f"b{start}-{time.monotonic_ns()}")
        tokens += run["output_tokens"]
        seconds += run["elapsed_s"]
        outputs += run["token_ids"]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "token_ids": outputs}


def run(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling import SamplingParams, StructuredOutputs

    common = dict(kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, show_progress=False)
    plain = LLM(args.model, dtype=args.dtype, **common)
    ngram = LLM(loaded=plain.core.loaded, speculative_config={
        "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
        **common)
    chat = [plain.apply_chat_template([{"role": "user", "content": CHAT_ASKS[i % 4].format(n=NAMES[i % 8])}])
            for i in range(args.num_prompts)]
    rng = random.Random(args.seed)
    docs = [plain.apply_chat_template([{"role": "user", "content": "Extract the invoice as JSON:\n\n"
                                                                   + invoice(rng)}])
            for _ in range(args.num_prompts)]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    masked = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            structured=StructuredOutputs(json=json.dumps(PROFILE)))
    extract = {compact: SamplingParams(
        max_tokens=args.extract_tokens, temperature=0.0,
        structured=StructuredOutputs(json=json.dumps(INVOICE), disable_any_whitespace=compact))
        for compact in (False, True)}
    levels = [1, args.concurrency]
    rounds: list[dict[str, Any]] = []
    _measure(plain, chat[:2], masked, 2)  # warm-up: grammar compiled, kernels built
    for r in range(args.rounds):
        row: dict[str, Any] = {"round": r}
        for c in levels:
            pair = [("free", free), ("json", masked)] if r % 2 == 0 else [("json", masked), ("free", free)]
            for name, params in pair:
                row[f"{name}@{c}"] = _measure(plain, chat, params, c)["tokens_per_s"]
        pair2 = [("plain", plain), ("ngram", ngram)] if r % 2 == 0 else [("ngram", ngram), ("plain", plain)]
        same = True
        for compact, suffix in ((False, ""), (True, "_compact")):
            outs: dict[str, Any] = {}
            for name, llm in pair2:
                outs[name] = _measure(llm, docs, extract[compact], 1)
                row[f"extract_{name}{suffix}"] = outs[name]["tokens_per_s"]
            same = same and outs["plain"]["token_ids"] == outs["ngram"]["token_ids"]
        row["extract_same_tokens"] = same
        rounds.append(row)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k not in ("round",
                                                                                   "extract_same_tokens")}

    def ratio(a: str, b: str) -> float:  # each round's own ratio (its variants ran back to back), median
        return statistics.median(r[a] / r[b] for r in rounds)

    ratios = {f"mask_cost@{c}": ratio(f"json@{c}", f"free@{c}") for c in levels}
    ratios["extract_ngram_vs_plain"] = ratio("extract_ngram", "extract_plain")
    ratios["extract_compact_ngram_vs_plain"] = ratio("extract_ngram_compact", "extract_plain_compact")
    lines = ["| measure | tokens/s (median of rounds) | ratio (median of the rounds' ratios) |",
             "|---|---|---|"]
    for c in levels:
        lines.append(f"| free, {c} in flight | {med[f'free@{c}']:.1f} | |")
        lines.append(f"| JSON schema, {c} in flight | {med[f'json@{c}']:.1f} | "
                     f"{ratios[f'mask_cost@{c}']:.3f}x |")
    for suffix, what in (("", ""), ("_compact", ", compact JSON (disable_any_whitespace)")):
        lines.append(f"| extraction{what}, constrained plain | {med['extract_plain' + suffix]:.1f} | |")
        gain = ratios["extract_compact_ngram_vs_plain" if suffix else "extract_ngram_vs_plain"]
        lines.append(f"| extraction{what}, constrained + ngram K={args.k} | "
                     f"{med['extract_ngram' + suffix]:.1f} | {gain:.3f}x |")
    table = "\n".join(lines)
    print(table)
    same = all(r["extract_same_tokens"] for r in rounds)
    print("extraction outputs identical with and without ngram:", same)
    result = {"date": time.strftime("%Y-%m-%d"), "model": plain.core.loaded.name,
              "precision": plain.core.loaded.precision, "args": vars(args) | {"bench_func": None},
              "rounds": rounds, "median_tokens_per_s": med, "ratios": ratios, "table": table}
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(dumps(result))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target (default: the default model)")
    p.add_argument("--dtype", default="auto",
                   help="weights: auto (as stored: 4-bit for the default model) or float32 (default: auto)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per variant (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="the loaded level (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per mask-cost request (default: 64)")
    p.add_argument("--extract-tokens", type=int, default=200, help="max tokens per extraction (default: 200)")
    p.add_argument("--k", type=int, default=4, help="ngram K (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="invoice generator seed (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--output", default=None, help="write the result JSON here")
