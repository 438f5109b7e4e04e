"""Weight precisions for `specserve bench offline --precisions`, and each one's agreement with float32.

A precision name maps onto the loader's `--dtype` / `--quantization`: `auto` (as stored: the default
model's 4-bit GGUF), `float32`, `bfloat16`, `float16`, `q8` / `q4` (MLX's quantizer at load, group 64).

Quality is measured teacher-forced on text no quantizer saw (MLX's affine quantizer is data-free): the
prose passages under loadtests/data/passages, written for this repository (the `copy` and `long`
datasets quote them in their prompts). At every position: whether the precision's top-1 token equals
float32's (top-1 agreement), and the perplexity of the text itself.
"""

from __future__ import annotations

import math
from typing import Any

PRECISIONS = ("auto", "float32", "bfloat16", "float16", "q8", "q4")
ACTIVATIONS = ("auto", "int8", "float32")


def split_precision(name: str) -> tuple[str, str]:
    """'WEIGHTS[:ACTIVATIONS]' -> (weight precision, activation precision; auto when not given)."""
    weights, _, acts = name.partition(":")
    return weights, acts or "auto"


def precision_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    parts = [split_precision(n) for n in names]
    bad = [n for n, (w, a) in zip(names, parts, strict=True) if w not in PRECISIONS or a not in ACTIVATIONS]
    if not names or bad or len(set(names)) != len(names):
        raise SystemExit(f"--precisions: expected distinct names WEIGHTS[:ACTIVATIONS] (weights "
                         f"{', '.join(PRECISIONS)}; activations {', '.join(ACTIVATIONS)}), got {text!r}")
    return names


def load_args(precision: str) -> dict[str, Any]:
    """load_model keyword arguments for a precision name."""
    weights = split_precision(precision)[0]
    if weights in ("q8", "q4"):
        return {"dtype": "auto", "quantization": weights}
    return {"dtype": weights, "quantization": None}


def engine_args(precision: str | None) -> dict[str, Any]:
    """EngineConfig keyword arguments for a precision name (its activation precision)."""
    return {"activation_precision": split_precision(precision)[1]} if precision else {}


def held_out_ids(tokenizer: Any, max_tokens: int = 512) -> list[list[int]]:
    from loadtests.datasets import load_passages

    texts = [t for _, kind, t in load_passages() if kind == "prose"]
    return [list(tokenizer.encode(t, add_special_tokens=True))[:max_tokens] for t in texts]


class _Scorer:
    """Logits at every position of a text, through the engine's own forward (the path that serves:
    the C layers where they run), one prefill step per text."""

    def __init__(self, loaded: Any, max_len: int, activations: str = "auto") -> None:
        from engine.config import EngineConfig
        from engine.core import EngineCore

        self.core = EngineCore(EngineConfig(kv_cache_memory="128MiB", max_model_len=max_len,
                                            max_num_batched_tokens=max_len, show_progress=False,
                                            activation_precision=activations), loaded)

    def logits(self, ids: list[int]) -> Any:
        from engine.models import adapter

        bs = self.core.kv_cache.block_size
        table = list(range((len(ids) + bs - 1) // bs))
        h = self.core.runner.forward_chunks([(ids, 0, table, len(ids))])
        return adapter.compute_logits(self.core.runner.model, h)  # [T, vocab]


def quality(loaded: Any, reference: Any, texts: list[list[int]], activations: str = "auto") -> dict[str, Any]:
    """Top-1 agreement with `reference` (float32) and both perplexities over `texts`."""
    import mlx.core as mx

    max_len = max(len(t) for t in texts)
    ours_m, ref_m = _Scorer(loaded, max_len, activations), _Scorer(reference, max_len, "float32")
    agree = total = 0
    nll = ref_nll = 0.0
    for ids in texts:
        if len(ids) < 2:
            continue
        ours, theirs = ours_m.logits(ids)[:-1], ref_m.logits(ids)[:-1]
        nxt = mx.array(ids[1:])
        agree += int(mx.sum(mx.argmax(ours, axis=-1) == mx.argmax(theirs, axis=-1)).item())
        for logits, acc in ((ours, "nll"), (theirs, "ref")):
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            s = -float(mx.sum(mx.take_along_axis(lp, nxt[:, None], axis=-1)).item())
            if acc == "nll":
                nll += s
            else:
                ref_nll += s
        total += len(ids) - 1
    return {"tokens": total, "top1_agreement": agree / total, "perplexity": math.exp(nll / total),
            "float32_perplexity": math.exp(ref_nll / total)}


def quality_table(rows: dict[str, tuple[str, dict[str, Any]]]) -> str:
    """rows: precision -> (weights description, quality)."""
    lines = ["| precision | weights | top-1 agreement with float32 | perplexity (float32) | tokens |",
             "|---|---|---:|---:|---:|"]
    for name, (weights, q) in rows.items():
        lines.append(f"| {name} | {weights} | {q['top1_agreement']:.3f} | {q['perplexity']:.2f} "
                     f"({q['float32_perplexity']:.2f}) | {q['tokens']} |")
    return "\n".join(lines)
