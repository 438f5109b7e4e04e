"""Issue #34 items 3, 4 and 7: bounded stop strings built off the engine thread, per-request fault
isolation with a non-zero exit when the engine loop itself breaks, and engine-request backpressure.
Real servers with the real default model; faults come from engine/faults.py (keyed by a prompt token)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.detokenize import StopMatcher, StopMatcherCache, stop_matcher
from engine.loop import FATAL_EXIT_CODE
from engine.stats import IterationStats, SpecDecodingStats
from loadtests.servers import free_port
from server.metrics import EngineSnapshot, Metrics
from tests.conftest import RunningServer
from tests.helpers import wait_healthy
from tests.server.api.test_server_errors import assert_openai_error
from tests.server.robustness.test_reliability import wait_for

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
MODEL = "SmolLM2-135M-Instruct"
TRIGGERS = {"add_request_error": 49105, "raise_in_forward": 49100}
_REQUEST_ID = re.compile(r"request (chat)?cmpl-[0-9a-f]{32}(-\d+)? failed")


def _body(prompt: list[int] | str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def _assert_engine_500(resp: httpx.Response, *hidden: str) -> None:
    """A 500 in OpenAI's shape that names the request and shows no exception text."""
    err = assert_openai_error(resp, 500)
    assert err["code"] == "engine_error" and _REQUEST_ID.search(err["message"]), err
    for text in ("Error", "injected", "Traceback", *hidden):
        assert text not in err["message"], err


# -- item 3: stop strings --------------------------------------------------------------------------
@pytest.mark.parametrize("path", [COMP, CHAT])
def test_stop_limits_are_400_naming_the_limit_and_flag(server: RunningServer, path: str) -> None:
    body = (lambda **kw: _body("The sky is", **kw)) if path == COMP else _chat
    cases = [
        ({"stop": [f"s{i}" for i in range(65)]}, "stop", "--max-stop-strings", "64"),
        ({"stop": ["x" * 4000, "y" * 4193]}, "stop", "--max-stop-chars", "8192"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids", "--max-stop-token-ids", "256"),
        ({"stop": ["zz"] * 5000}, "stop", "--max-stop-strings", "64"),  # duplicates count
    ]
    for fields, param, flag, limit in cases:
        err = assert_openai_error(httpx.post(server.url + path, json=body(**fields), timeout=60), 400, param)
        assert flag in err["message"] and limit in err["message"], err
    head = [f"q{i}" for i in range(63)]
    at_limit = {"stop": [*head, "w" * (8192 - sum(map(len, head)))], "stop_token_ids": list(range(1, 257))}
    assert sum(map(len, at_limit["stop"])) == 8192 and len(at_limit["stop"]) == 64
    assert httpx.post(server.url + path, json=body(**at_limit), timeout=60).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    wait_for(server.idle, timeout=5)


def test_stop_limit_flags_raise_the_limits(make_server) -> None:  # noqa: ANN001
    stops = [f"never-{i}-" + "v" * 200 for i in range(100)]
    with make_server(max_stop_strings=100, max_stop_chars=30_000, max_stop_token_ids=1000) as srv:
        r = httpx.post(srv.url + COMP, json=_body("The sky is", stop=stops, stop_token_ids=list(range(1000))),
                       timeout=60)
        assert r.status_code == 200, r.text
        over = httpx.post(srv.url + COMP, json=_body("Hi", stop=[*stops, "x"]), timeout=60)
        assert "--max-stop-strings" in assert_openai_error(over, 400, "stop")["message"]


def test_stop_matcher_is_built_off_the_engine_thread(server: RunningServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    built_on: list[str] = []
    build = StopMatcher.build.__func__  # type: ignore[attr-defined]

    def spy(cls: type[StopMatcher], stops: tuple[str, ...]) -> StopMatcher:
        built_on.append(threading.current_thread().name)
        return build(cls, stops)

    monkeypatch.setattr(StopMatcher, "build", classmethod(spy))
    unique = f"stop-{uuid.uuid4().hex}"  # not in the matcher cache
    prompt = server.core.tokenizer.encode("The capital of France is")
    plain = httpx.post(server.url + COMP, json=_body(prompt, n=2), timeout=60).json()
    r = httpx.post(server.url + COMP, json=_body(prompt, n=2, stop=[unique, unique + "x"]), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][1]["text"] == plain["choices"][1]["text"]
    assert len(built_on) == 1, built_on  # once for both choices
    assert built_on[0] not in ("specserve-engine", "uvicorn-test"), built_on  # neither engine nor event loop


def test_stop_matcher_failure_fails_only_that_request(server: RunningServer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    build = StopMatcher.build.__func__  # type: ignore[attr-defined]

    def failing(cls: type[StopMatcher], stops: tuple[str, ...]) -> StopMatcher:
        if any(s.startswith("OOM-") for s in stops):
            raise MemoryError
        if any(s.startswith("BUG-") for s in stops):
            raise RuntimeError("secret internal detail")
        return build(cls, stops)

    monkeypatch.setattr(StopMatcher, "build", classmethod(failing))
    tag = uuid.uuid4().hex
    oom = httpx.post(server.url + COMP, json=_body("Hi", stop=[f"OOM-{tag}"]), timeout=60)
    assert assert_openai_error(oom, 400, "stop")["code"] == "stop_too_long"
    bug = httpx.post(server.url + CHAT, json=_chat(stop=[f"BUG-{tag}"]), timeout=60)
    err = assert_openai_error(bug, 500)
    assert _REQUEST_ID.search(err["message"]) and "secret" not in err["message"], err
    ok = httpx.post(server.url + COMP, json=_body("Hi", stop=[f"fine-{tag}"]), timeout=60)
    assert ok.status_code == 200 and server.client.alive
    wait_for(server.idle, timeout=5)


def test_stop_matcher_cache_is_bounded_by_bytes() -> None:
    cache = StopMatcherCache(max_bytes=2**20)
    lists = [tuple(f"{i}-{j}-" + "abcdefgh" * 30 for j in range(4)) for i in range(40)]  # ~1000 nodes each
    for stops in lists:
        assert cache.get(stops) is not None
        assert cache.nbytes <= cache.max_bytes
    assert 0 < len(cache) < len(lists)  # old lists were evicted by size, not by count
    assert cache.get(lists[-1]) is cache.get(lists[-1])  # the newest is kept and reused
    kept, nbytes = len(cache), cache.nbytes
    assert cache.get(("z" * 20_000,)).match_len[-1] == 20_000  # built, but too big to keep
    assert (len(cache), cache.nbytes) == (kept, nbytes)
    assert stop_matcher(["", "a", "a"], cache=None).goto[0].keys() == {"a"}  # deduped, empties dropped
    assert stop_matcher([]) is None


@pytest.mark.parametrize("alphabet", ["abcdefghijklmnopqrstuvwxyz", "".join(map(chr, range(0x4E00, 0x4E40)))])
def test_stop_matcher_size_estimate_errs_high(alphabet: str) -> None:
    import random

    rng = random.Random(0)
    stops = tuple("".join(rng.choice(alphabet) for _ in range(128)) for _ in range(64))  # 8 KiB of text
    tracemalloc.start()
    try:
        matcher = StopMatcher.build(stops)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held <= matcher.nbytes <= 2 * held, (held, matcher.nbytes)


# -- item 4: one request's failure stays its own; a broken loop exits non-zero ---------------------
@pytest.fixture(scope="module")
def faulty(make_server) -> Iterator[RunningServer]:  # noqa: ANN001
    with make_server(fault_injection=TRIGGERS) as srv:
        yield srv


def test_failures_while_taking_a_request_in_fail_only_it(faulty: RunningServer) -> None:
    tok = faulty.core.tokenizer
    good = [tok.encode("The capital of France is"), tok.encode("Write a list of fruits: apple, banana,")]
    alone = [httpx.post(faulty.url + COMP, json=_body(p, max_tokens=24), timeout=120).json()
             ["choices"][0]["text"] for p in good]

    async def scenario() -> tuple[list[list[str]], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=faulty.url, timeout=120) as c:
            async def stream(p: list[int]) -> list[str]:
                async with c.stream("POST", COMP, json=_body(p, max_tokens=24, stream=True)) as r:
                    return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]

            tasks = [asyncio.ensure_future(stream(p)) for p in good]
            deadline = time.monotonic() + 30
            while len(faulty.core.scheduler.running) < len(good):  # both are running
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            bad = await asyncio.gather(
                c.post(COMP, json=_body(good[0] + [TRIGGERS["add_request_error"]])),
                c.post(COMP, json=_body(good[1] + [TRIGGERS["raise_in_forward"]])))
            return list(await asyncio.gather(*tasks)), list(bad)

    streams, bad = asyncio.run(scenario())
    for events, expected in zip(streams, alone, strict=True):
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
        assert text == expected  # untouched by the failures beside them
    _assert_engine_500(bad[0], "MemoryError")
    _assert_engine_500(bad[1], "InjectedFault")
    wait_for(faulty.idle, timeout=5)  # every KV block back in the pool
    assert faulty.client.alive and httpx.get(faulty.url + "/health").status_code == 200
    again = httpx.post(faulty.url + COMP, json=_body(good[0], max_tokens=24), timeout=120)
    assert again.json()["choices"][0]["text"] == alone[0]


def test_a_broken_engine_loop_fails_everyone_and_calls_the_exit_hook(make_server,  # noqa: ANN001
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with make_server() as srv:
        codes: list[int] = []
        srv.client.exit_hook = codes.append

        def broken(*_: Any) -> Any:
            raise RuntimeError("scheduler invariant broken")

        monkeypatch.setattr(srv.core.scheduler, "schedule", broken)
        r = httpx.post(srv.url + COMP, json=_body("Hi"), timeout=30)
        assert r.status_code == 500 and "invariant" not in r.text and _REQUEST_ID.search(r.text), r.text
        wait_for(lambda: bool(codes), timeout=5)
        assert codes == [FATAL_EXIT_CODE] and FATAL_EXIT_CODE != 0
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "invariant" not in health.text


def test_forward_failing_for_every_request_twice_in_a_row_is_fatal(make_server,  # noqa: ANN001
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with make_server() as srv:
        codes: list[int] = []
        srv.client.exit_hook = codes.append

        def device_lost(*_: Any) -> Any:
            raise RuntimeError("device lost")

        monkeypatch.setattr(srv.core.runner, "execute", device_lost)
        _assert_engine_500(httpx.post(srv.url + COMP, json=_body("Hi"), timeout=30), "device lost")
        assert srv.client.alive and not codes  # once could be that request's own fault
        second = httpx.post(srv.url + COMP, json=_body("Hello"), timeout=30)
        assert second.status_code == 500 and "device lost" not in second.text
        wait_for(lambda: bool(codes), timeout=5)
        assert codes == [FATAL_EXIT_CODE] and not srv.client.alive
        assert srv.kv_pool_full()


def test_serve_exits_non_zero_when_the_engine_cannot_go_on(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = tmp_path / "serve.yaml"
    config.write_text(f"port: {port}\nmax-model-len: 512\nkv-cache-memory: 64MiB\n"
                      f"fault_injection: {{raise_in_forward: {TRIGGERS['raise_in_forward']}}}\n")
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_API_KEY"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])  # this checkout's code
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(config)],
                                stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    try:
        wait_healthy(proc, url, log)
        poison = _body([1, 2, 3, TRIGGERS["raise_in_forward"]])
        assert httpx.post(url + COMP, json=poison, timeout=60).status_code == 500
        with contextlib.suppress(httpx.TransportError):  # the server may already be going away
            assert httpx.post(url + COMP, json=poison, timeout=60).status_code == 500
        assert proc.wait(timeout=60) == FATAL_EXIT_CODE, log.read_text()
        assert f"exiting with status {FATAL_EXIT_CODE}" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- item 7: backpressure counts engine requests; the metrics buffer is bounded --------------------
def test_max_waiting_requests_counts_engine_requests(make_server) -> None:  # noqa: ANN001
    with make_server(max_num_seqs=1, max_waiting_requests=2) as srv:
        long = _body([1, 2, 3, 4], max_tokens=400, stream=True)
        with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", COMP, json=long) as first:
            for line in first.iter_lines():  # the first request holds the only running slot
                if line.startswith("data: "):
                    break
            over = c.post(COMP, json=_body([5, 6, 7], n=3, max_tokens=2))  # 3 engine requests, 2 may wait
            assert assert_openai_error(over, 503)["code"] == "server_overloaded"
            assert over.headers["retry-after"] == "1"
            prompts = c.post(COMP, json=_body([[5, 6], [7, 8], [9, 1]], max_tokens=2))  # 3 prompts: the same
            assert assert_openai_error(prompts, 503)["code"] == "server_overloaded"
            never = c.post(COMP, json=_body([5, 6, 7], n=4, max_tokens=2))  # more than 2 waiting + 1 running
            assert "--max-waiting-requests" in assert_openai_error(never, 400, "n")["message"]
            assert len(srv.core.scheduler.waiting) == 0
        fits = httpx.post(srv.url + COMP, json=_body([5, 6, 7], n=2, max_tokens=2), timeout=60)
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
        wait_for(srv.idle, timeout=5)


def test_acceptance_buffer_is_bounded_without_scrapes() -> None:
    metrics = Metrics("m", lambda: EngineSnapshot(0, 0, 1, 1), num_speculative_tokens=3)

    def step() -> None:
        spec = SpecDecodingStats(num_drafts=1, num_draft_tokens=3, num_accepted_tokens=2,
                                 accepted_per_pos=[1, 1, 0])
        metrics.on_iteration(IterationStats(0.0, 0.0, 1, 0, 3, 1, 0, 0.0, 0, 0, 0, spec=spec))

    for _ in range(1000):
        step()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(50_000):  # many steps and no /metrics scrape
            step()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 64 * 1024, after - before
    rate = [line for line in metrics.render().decode().splitlines()
            if line.startswith("vllm:spec_decode_draft_acceptance_rate{")]
    assert rate and abs(float(rate[0].rsplit(" ", 1)[1]) - 2 / 3) < 1e-9
