"""Soak: a long mix of streaming, non-streaming, disconnecting, sampled and malformed requests against one
server with speculation on (greedy requests draft, sampled ones skip drafting in the same batches).

Afterwards nothing is running, the KV pool is full again, RSS grew by less than a stated bound, and
every completed greedy answer equals the one the same server gave alone. The quick variant runs in the
default suite; `pytest -m slow tests/server/robustness/test_soak.py` runs thousands of requests
(`SOAK_REQUESTS` overrides the count).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer

COMP = "/v1/completions"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PROMPTS = ["The capital of France is", "one two three one two three one two", "List three colours:",
           "def square(x):\n    return x * x\n\ndef cube(x):", "Say hello in French.", "A B C D A B C D A"]
BAD_BODIES: list[Any] = ['{"prompt": ', '{"model": "m", "prompt": "hi", "max_tokens": -1}', "[]",
                         '{"model": "m", "prompt": [1, 99999999]}',
                         '{"model": "m", "prompt": "hi", "n": 9999}', b'{"model": "m", "prompt": "\xff"}']
RSS_BOUND_MB = 400  # growth allowed over the run (allocator caches, MLX buffers), far below a leak's


def _rss_mb() -> float:
    with open("/proc/self/status") as f:  # current RSS, not the peak
        line = next(ln for ln in f if ln.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.fixture(scope="module")
def soak_server(make_server) -> Iterator[RunningServer]:  # noqa: ANN001
    with make_server(speculative_config=NGRAM, max_num_seqs=16) as srv:
        yield srv


def _greedy(model: str, prompt: str, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}


async def _one(c: httpx.AsyncClient, model: str, rng: random.Random, refs: dict[str, str],
               tally: Counter[str]) -> None:
    kind = rng.choices(["greedy", "stream", "disconnect", "sampled", "bad"], [3, 3, 2, 2, 1])[0]
    prompt = rng.choice(PROMPTS)
    if kind == "greedy":
        r = await c.post(COMP, json=_greedy(model, prompt))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == refs[prompt], prompt
    elif kind in ("stream", "disconnect"):
        text, n = [], 0
        async with c.stream("POST", COMP, json=_greedy(model, prompt, stream=True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                n += 1
                if kind == "disconnect" and n >= 2:
                    break  # leaving the block closes the connection mid-stream
                chunk = httpx.Response(200, content=line[6:]).json()
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
        if kind == "stream":
            assert "".join(text) == refs[prompt], prompt
    elif kind == "sampled":
        body = {**_greedy(model, prompt), "temperature": rng.uniform(0.5, 1.0), "top_p": 0.9}
        r = await c.post(COMP, json=body)
        assert r.status_code == 200, r.text
    else:
        raw = rng.choice(BAD_BODIES)
        r = await c.post(COMP, content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, r.text
    tally[kind] += 1


async def _soak(srv: RunningServer, n: int, concurrency: int, seed: int) -> Counter[str]:
    model = srv.client.model_name
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
        refs = {}
        for p in PROMPTS:  # each prompt alone first: the reference every later answer must equal
            refs[p] = (await c.post(COMP, json=_greedy(model, p))).json()["choices"][0]["text"]
        tally: Counter[str] = Counter()
        rng = random.Random(seed)
        sem = asyncio.Semaphore(concurrency)

        async def guarded() -> None:
            async with sem:
                await _one(c, model, rng, refs, tally)

        await asyncio.gather(*(guarded() for _ in range(n)))
    return tally


def _run(srv: RunningServer, n: int) -> dict[str, Any]:
    rss0, t0 = _rss_mb(), time.monotonic()
    tally = asyncio.run(_soak(srv, n, concurrency=16, seed=n))
    deadline = time.monotonic() + 5
    while not srv.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    report = {"requests": n, "seconds": round(time.monotonic() - t0, 1), "kinds": dict(tally),
              "rss_growth_mb": round(_rss_mb() - rss0, 1)}
    print(f"\nsoak: {report}")
    assert sum(tally.values()) == n
    assert srv.idle(), "requests left running or KV blocks not returned"
    assert srv.client.alive
    assert report["rss_growth_mb"] < RSS_BOUND_MB, report
    return report


def test_soak_quick(soak_server: RunningServer) -> None:
    report = _run(soak_server, 200)
    assert all(report["kinds"].get(k, 0) > 0 for k in ("greedy", "stream", "disconnect", "sampled", "bad"))


@pytest.mark.slow
def test_soak_long(soak_server: RunningServer) -> None:
    report = _run(soak_server, int(os.environ.get("SOAK_REQUESTS", "3000")))
    assert report["kinds"]["disconnect"] > 100
