"""Shared test helpers: one float32 default model per process, an mlx-lm reference decoder, a Hub
cache laid out as huggingface_hub writes it and a Python run offline against it."""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _gammaincc(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x): series below a + 1, Lentz continued fraction above."""
    if x <= 0.0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / (a + n)
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_sf(x: float, df: int) -> float:
    return _gammaincc(df / 2.0, x / 2.0)


def hub_repo(cache: Path, repo_id: str, snapshots: dict[str, Path], refs: dict[str, str]) -> Path:
    """A Hub cache entry as huggingface_hub lays it out: snapshots/<commit>/..., refs/<ref> -> commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for commit, folder in snapshots.items():
        shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)
    return repo


def run_offline(code: str, cache: Path, home: Path, timeout: int = 300) -> list[str]:
    """Run `code` in a fresh Python (huggingface_hub reads its cache location at import) with the Hub
    offline and `cache` as its cache; returns stdout's lines, failing the test on a non-zero exit."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(home))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()


def scale_weights(model: Any) -> None:
    """Multiply a random-weight transformers model's matrices by 4: greedy choices land far from ties."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)


def save_with_default_tokenizer(model: Any, folder: Path) -> None:
    """Save a tiny transformers model as a Hugging Face folder with the default model's tokenizer files."""
    from engine.models.loader import default_model_folder

    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_folder(progress=False) / name, folder / name)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    """Until a server process started from the CLI answers /health with 200; fails with the end of its
    log if it exits or the time runs out."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no healthy server at {url}: {log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
