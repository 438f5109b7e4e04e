"""Shared test helpers: one float32 default model per process, an mlx-lm reference decoder."""

from __future__ import annotations

import functools

import mlx.core as mx

from engine.llm import LLM
from engine.models.loader import LoadedModel, load_model


@functools.cache
def default_model() -> LoadedModel:
    return load_model(None, dtype="float32", progress=False)


def make_llm(**kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "512MiB")
    kwargs.setdefault("max_model_len", 2048)
    kwargs.setdefault("show_progress", False)
    return LLM(loaded=kwargs.pop("loaded", None) or default_model(), **kwargs)


def reference_greedy(loaded: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain non-paged decode with mlx-lm's own generate_step and KV cache (float32 argmax)."""
    from mlx_lm.generate import generate_step

    eos = set(loaded.eos_token_ids)
    out: list[int] = []
    for tok, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=max_tokens,
                                sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(tok))
        if out[-1] in eos:
            break
    return out


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in two sentences why the sky is blue, for a child who asks many questions "
    "about the world, the weather, the sun and the moon.",
    "hi",
    "Translate 'good morning' into Spanish, French and German, and say which is the most common "
    "greeting in each country. Then give a short example dialogue in each language where two "
    "friends meet at a cafe in the morning and order coffee and croissants together.",
    "Summarise the plot of Romeo and Juliet.",
    "Count from one to twenty in words, separated by commas: one, two, three,",
]


def chat_prompts(llm: LLM, texts: list[str] = CHATS) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
