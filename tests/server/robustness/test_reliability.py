"""Reliability: fault isolation, request timeouts, engine death, cancellation with a draft model, hostile
input. Real servers with the real default model; faults come from the engine's test-only injector
(engine/faults.py), keyed by a trigger token in the prompt."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.servers import free_port
from tests.conftest import RunningServer
from tests.helpers import wait_healthy
from tests.server.api.test_server_errors import assert_openai_error

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
MODEL = "SmolLM2-135M-Instruct"
# Rare token ids used as fault triggers (kept out of the good prompts).
TRIGGERS = {"raise_in_forward": 49100, "nan_logits": 49101, "bad_token": 49102, "proposer_error": 49103,
            "detokenize_error": 49104}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def wait_for(cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _prompts(srv: RunningServer) -> list[list[int]]:
    tok = srv.core.tokenizer
    texts = ["The capital of France is", "one two three four one two three four one two",
             "Write a list of fruits: apple, banana,", "def add(a, b):\n    return a + b\n\ndef sub(a, b):"]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def faulty(make_server) -> Iterator[RunningServer]:  # noqa: ANN001
    with make_server(speculative_config=NGRAM, fault_injection=TRIGGERS) as srv:
        yield srv


async def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        return await asyncio.gather(*(c.post(COMP, json=b) for b in bodies))


def _body(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **kw}


def test_each_fault_fails_only_its_request_in_a_batch(faulty: RunningServer) -> None:
    good = _prompts(faulty)[:2]  # a plain prompt and one that ngram drafts for
    alone = [httpx.post(faulty.url + COMP, json=_body(p), timeout=120).json()["choices"][0]["text"]
             for p in good]
    bad = {kind: good[0] + [tok] for kind, tok in TRIGGERS.items()}
    bodies = [_body(p) for p in good] + [_body(p) for p in bad.values()] + [
        _body(good[1], temperature=0.9, seed=3)]  # a sampled request in the same batches
    responses = asyncio.run(_post_all(faulty.url, bodies))
    for resp, expected in zip(responses[: len(good)], alone, strict=True):
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected  # untouched by its neighbours' faults
    by_kind = dict(zip(bad, responses[len(good): len(good) + len(bad)], strict=True))
    # the cause goes to the log; the body gives the engine's short reason
    assert_openai_error(by_kind["raise_in_forward"], 500, contains="the forward pass failed")
    assert_openai_error(by_kind["nan_logits"], 500, contains="non-finite logits")
    assert_openai_error(by_kind["bad_token"], 500, contains="outside the vocabulary")
    assert_openai_error(by_kind["detokenize_error"], 500, contains="detokenization failed")
    # A failing proposer only turns speculation off for its request: the answer still comes, exact.
    proposer = by_kind["proposer_error"]
    assert proposer.status_code == 200, proposer.text
    solo = httpx.post(faulty.url + COMP, json=_body(bad["proposer_error"]), timeout=120)
    assert proposer.json()["choices"][0]["text"] == solo.json()["choices"][0]["text"]
    assert responses[-1].status_code == 200
    wait_for(faulty.idle, timeout=5)
    assert faulty.client.alive and httpx.get(faulty.url + "/health").status_code == 200


def test_streamed_fault_ends_with_an_error_event(faulty: RunningServer) -> None:
    body = _body(_prompts(faulty)[0] + [TRIGGERS["nan_logits"]], stream=True)
    with httpx.stream("POST", faulty.url + COMP, json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    wait_for(faulty.idle, timeout=5)


def test_request_timeout_aborts_and_frees_blocks(make_server) -> None:  # noqa: ANN001
    with make_server(request_timeout=0.6) as srv:
        slow = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
        t0 = time.monotonic()
        err = assert_openai_error(httpx.post(srv.url + COMP, json=slow, timeout=60), 408)
        assert err["code"] == "request_timeout" and time.monotonic() - t0 < 5
        with httpx.stream("POST", srv.url + COMP, json={**slow, "stream": True}, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
        wait_for(srv.idle, timeout=2)
        quick = httpx.post(srv.url + COMP, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert quick.status_code == 200


def test_disconnect_frees_target_and_draft_blocks(make_server) -> None:  # noqa: ANN001
    spec = {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 2}
    with make_server(speculative_config=spec) as srv:
        draft_kv = srv.core.speculation.proposer.kv
        body = {"model": MODEL, "prompt": "Count: one, two, three,", "max_tokens": 500, "temperature": 0,
                "ignore_eos": True, "stream": True}

        async def open_and_drop() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c, \
                    c.stream("POST", COMP, json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 4:
                        break

        asyncio.run(open_and_drop())
        wait_for(srv.idle, timeout=3)
        assert draft_kv.num_free_blocks == draft_kv.pool.num_blocks  # the draft's own pool too
        assert srv.core.speculation.proposer is not None and srv.client.alive


def test_engine_thread_death_gives_503_not_hangs(make_server, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    with make_server() as srv:
        def explode() -> Any:
            raise RuntimeError("scheduler invariant broken")

        monkeypatch.setattr(srv.core.scheduler, "schedule", explode)
        resp = httpx.post(srv.url + COMP, json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert resp.status_code >= 500 and "scheduler invariant broken" not in resp.text  # only in the log
        wait_for(lambda: not srv.client.alive, timeout=5)
        assert_openai_error(httpx.get(srv.url + "/health"), 503)
        t0 = time.monotonic()
        late = httpx.post(srv.url + COMP, json={"model": MODEL, "prompt": "Hi"}, timeout=30)
        assert_openai_error(late, 503)
        assert time.monotonic() - t0 < 2


# -- hostile input ---------------------------------------------------------------------------------
def _deep(n: int) -> str:
    return '{"model": "m", "prompt": ' + "[" * n + "1" + "]" * n + "}"


HOSTILE: list[tuple[str, str, dict[str, str] | None, bytes | str | None]] = [
    # (name, path, headers, raw body); bodies that are not JSON objects go raw
    ("deeply nested JSON", COMP, None, _deep(100_000)),
    ("invalid UTF-8", COMP, None, b'{"model": "m", "prompt": "\xff\xfe\xfa"}'),
    ("NaN literal", COMP, None, '{"model": "m", "prompt": "hi", "temperature": NaN}'),
    ("Infinity max_tokens", COMP, None, '{"model": "m", "prompt": "hi", "max_tokens": Infinity}'),
    ("negative max_tokens", COMP, None, '{"model": "m", "prompt": "hi", "max_tokens": -5}'),
    ("giant max_tokens", COMP, None, '{"model": "m", "prompt": "hi", "max_tokens": 1e300}'),
    ("giant integer", COMP, None, '{"model": "m", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}"),
    ("max_tokens beyond the context", COMP, None, '{"model": "m", "prompt": "hi", "max_tokens": 1000000000}'),
    ("negative top_k", COMP, None, '{"model": "m", "prompt": "hi", "top_k": -7}'),
    ("negative temperature", COMP, None, '{"model": "m", "prompt": "hi", "temperature": -1}'),
    ("top_p above one", CHAT, None, '{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
                                    '"top_p": 1.5}'),
    ("token id out of vocabulary", COMP, None, '{"model": "m", "prompt": [1, 2, 99999999]}'),
    ("negative token id", COMP, None, '{"model": "m", "prompt": [1, -2]}'),
    ("wrong content type", COMP, {"content-type": "text/plain"}, "prompt=hi"),
    ("empty body", COMP, None, ""),
    ("array body", CHAT, None, "[1, 2, 3]"),
    ("control characters in role", CHAT, None,
     '{"model": "m", "messages": [{"role": "us\\u0000er", "content": "hi"}]}'),
    ("stop not a string", COMP, None, '{"model": "m", "prompt": "hi", "stop": [{"a": 1}]}'),
    ("huge n", COMP, None, '{"model": "m", "prompt": "hi", "n": 100000}'),
    ("detokenize huge id", "/detokenize", None, '{"tokens": [18446744073709551616]}'),
]


@pytest.mark.parametrize(("name", "path", "headers", "raw"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_is_4xx(server: RunningServer, name: str, path: str, headers: dict[str, str] | None,
                              raw: bytes | str) -> None:
    resp = httpx.post(server.url + path, content=raw,
                      headers=headers or {"content-type": "application/json"}, timeout=30)
    assert 400 <= resp.status_code < 500, (name, resp.status_code, resp.text[:300])
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").status_code == 200


def test_control_characters_and_many_stop_strings_are_served(server: RunningServer) -> None:
    # Legal but nasty: control characters in the prompt, thousands of stop strings.
    stops = [f"zz{i}qq" for i in range(2000)]
    r = httpx.post(server.url + COMP, timeout=60, json={
        "model": MODEL, "prompt": "a\u0000b\u0007c\u001b[31m\ud7ff\ufffd", "max_tokens": 4, "stop": stops})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:  # a limit on stop strings is fine, if it says so
        assert "stop" in r.json()["error"]["message"]
    r = httpx.post(server.url + COMP, timeout=60, json={"model": MODEL, "prompt": "The sky is",
                                                        "max_tokens": 4, "stop": stops[:16]})
    assert r.status_code == 200


@pytest.fixture(scope="module")
def short_context(make_server) -> Iterator[RunningServer]:  # noqa: ANN001
    with make_server(max_model_len=160) as srv:  # a full-length prompt costs little to prefill
        yield srv


def test_prompt_lengths_at_the_limit(short_context: RunningServer) -> None:
    server = short_context
    limit = server.core.max_model_len
    at = {"model": MODEL, "prompt": [1] * limit, "max_tokens": 1}
    assert_openai_error(httpx.post(server.url + COMP, json=at, timeout=60), 400, contains=str(limit))
    over = {"model": MODEL, "prompt": [1] * (limit - 1), "max_tokens": 5}  # prompt + max_tokens too long
    assert_openai_error(httpx.post(server.url + COMP, json=over, timeout=60), 400, contains=str(limit))
    below = {**over, "max_tokens": 1}
    r = httpx.post(server.url + COMP, json=below, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1  # room for one token
    wait_for(server.idle, timeout=5)


def test_api_key_never_logged(make_server, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    import logging

    key = "sk-very-secret-4f1c9a"
    caplog.set_level(logging.DEBUG)
    with make_server(api_key=key, disable_log_requests=False) as srv:
        ok = httpx.post(srv.url + COMP, headers={"Authorization": f"Bearer {key}"}, timeout=60,
                        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        wrong = httpx.post(srv.url + COMP, headers={"Authorization": f"Bearer {key[:-1]}x"}, timeout=60,
                           json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and wrong.status_code == 401
    assert caplog.messages, "nothing was logged: the check would prove nothing"
    assert key not in caplog.text and key[:-1] not in caplog.text


# -- backpressure, cancellation bookkeeping, graceful shutdown ------------------------------------
def test_backpressure_bounds_the_queue_under_a_burst(make_server) -> None:  # noqa: ANN001
    limit, burst = 2, 24
    with make_server(max_num_seqs=1, max_waiting_requests=limit) as srv:
        peak = {"waiting": 0, "engine_waiting": 0}
        stop = threading.Event()

        def watch() -> None:  # the queue's size over the whole burst, not only at the end
            while not stop.is_set():
                peak["waiting"] = max(peak["waiting"], srv.client.num_waiting())
                peak["engine_waiting"] = max(peak["engine_waiting"], len(srv.core.scheduler.waiting))
                time.sleep(0.002)

        async def scenario() -> tuple[list[httpx.Response], list[str]]:
            long = _body([1, 2, 3, 4], max_tokens=48, stream=True)
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c, \
                    c.stream("POST", COMP, json=long) as first:
                lines = first.aiter_lines()
                async for line in lines:  # the first request is running: every later one must queue
                    if line.startswith("data: "):
                        break
                out = await asyncio.gather(*(c.post(COMP, json=_body([5, 6, 7], max_tokens=2))
                                             for _ in range(burst)))
                rest = [line async for line in lines if line.startswith("data: ")]
            return out, rest

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            responses, rest = asyncio.run(scenario())
        finally:
            stop.set()
            watcher.join()
        ok = [r for r in responses if r.status_code == 200]
        over = [r for r in responses if r.status_code != 200]
        assert len(ok) >= limit and len(over) >= burst // 2, [r.status_code for r in responses]
        for r in over:
            assert assert_openai_error(r, 503)["code"] == "server_overloaded"
            assert r.headers["retry-after"] == "1"
        assert all(r.json()["usage"]["completion_tokens"] == 2 for r in ok)  # admitted ones all finish
        assert rest[-1] == "data: [DONE]"
        assert peak["waiting"] <= limit and peak["engine_waiting"] <= limit, peak
        wait_for(srv.idle, timeout=5)


def test_cancellation_keeps_prefix_refcounts_and_frees_draft_blocks(make_server) -> None:  # noqa: ANN001
    # A draft model has a KV pool of its own: disconnects and timeouts must empty both pools, and
    # an aborted request sharing cached prefix blocks must drop exactly its own references.
    spec = {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 2}
    with make_server(speculative_config=spec, request_timeout=6) as srv:
        pool, draft_kv = srv.core.kv.pool, srv.core.speculation.proposer.kv
        tok = srv.core.tokenizer
        prefix = tok.encode("The quick brown fox jumps over the lazy dog. " * 8)[:48]  # 3 full blocks
        a, b = prefix + tok.encode(" Count to ten:"), prefix + tok.encode(" Name three colours:")
        ref = httpx.post(srv.url + COMP, json=_body(b, max_tokens=24), timeout=120).json()
        ref_text = ref["choices"][0]["text"]
        shared_seen: list[int] = []

        async def drop_a_keep_b() -> str:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c, \
                    contextlib.AsyncExitStack() as holder_a:
                ra = await holder_a.enter_async_context(
                    c.stream("POST", COMP, json=_body(a, max_tokens=400, stream=True)))
                lines_a = ra.aiter_lines()
                async with c.stream("POST", COMP, json=_body(b, max_tokens=24, stream=True)) as rb:
                    text: list[str] = []
                    async for line in rb.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                        if len(text) == 2:  # both running now: the prefix blocks have two holders
                            async for la in lines_a:
                                if la.startswith("data: "):
                                    break
                            shared_seen.append(sum(blk.ref_cnt == 2 for blk in pool.blocks))
                            await holder_a.aclose()  # A's client goes away mid-stream
                return "".join(text)

        assert asyncio.run(drop_a_keep_b()) == ref_text  # B unharmed by A's abort
        assert shared_seen and shared_seen[0] >= 3, shared_seen
        slow = _body([1, 2, 3], max_tokens=1500)
        assert assert_openai_error(httpx.post(srv.url + COMP, json=slow, timeout=60), 408)[
            "code"] == "request_timeout"
        wait_for(srv.idle, timeout=5)
        assert all(blk.ref_cnt == 0 for blk in pool.blocks)  # no reference leaked, none freed twice
        assert draft_kv.num_free_blocks == draft_kv.pool.num_blocks
        assert all(blk.ref_cnt == 0 for blk in draft_kv.pool.blocks)
        again = httpx.post(srv.url + COMP, json=_body(b, max_tokens=24), timeout=120).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prefix)  # still cached
        assert again["choices"][0]["text"] == ref_text
        wait_for(srv.idle, timeout=5)
        assert srv.client.alive


def test_sigterm_finishes_short_requests_aborts_long_ones_exits_0(tmp_path: Path) -> None:
    key, grace = "sk-shutdown-secret-93b2e7", 8.0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    log = tmp_path / "serve.log"
    specserve = str(Path(sys.executable).parent / "specserve")
    with log.open("w") as f:
        proc = subprocess.Popen([specserve, "serve", "--port", str(port), "--max-model-len", "2048",
                                 "--kv-cache-memory", "256MiB", "--log-level", "debug", "--api-key", key,
                                 "--shutdown-timeout", str(grace), "--log-stats-interval", "1"],
                                stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env={k: v for k, v in os.environ.items() if k != "SPECSERVE_API_KEY"})
    try:
        wait_healthy(proc, url, log)
        assert httpx.post(url + COMP, json=_body([1, 2], max_tokens=2), timeout=30,
                          headers={"Authorization": f"Bearer {key[:-1]}0"}).status_code == 401
        streams: dict[str, list[str]] = {"short": [], "long": []}
        ended: dict[str, float] = {}

        def read(name: str, max_tokens: int) -> None:
            body = _body([1, 2, 3, 4, 5], max_tokens=max_tokens, stream=True)
            with httpx.stream("POST", url + COMP, json=body, headers=auth, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        streams[name].append(line[6:])
            ended[name] = time.monotonic()

        readers = [threading.Thread(target=read, args=a) for a in (("short", 40), ("long", 1900))]
        for t in readers:
            t.start()
        wait_for(lambda: all(streams.values()) or len(ended) > 0, timeout=60)
        assert not ended, "a stream ended before SIGTERM"
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        refused = False  # admissions stop at once, while the long request is still running
        while not refused and time.monotonic() - t_term < grace - 1:
            try:
                r = httpx.post(url + COMP, json=_body([1, 2], max_tokens=2), headers=auth, timeout=5)
                refused = r.status_code == 503
            except httpx.TransportError:
                refused = True
            time.sleep(0.1)
        assert refused and "long" not in ended
        assert proc.wait(timeout=grace + 30) == 0
        for t in readers:
            t.join(10)
        short, long = streams["short"], streams["long"]
        assert short[-1] == "[DONE]", short
        assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length", short  # not cut off
        assert all("error" not in json.loads(e) for e in short[:-1])
        assert long[-1] == "[DONE]" and json.loads(long[-2])["error"]["code"] == "aborted", long[-3:]
        assert ended["long"] - t_term >= grace - 0.5  # it got its grace period
        text = log.read_text()
        assert "stopped" in text and "Traceback" not in text
        assert key not in text and key[:-1] not in text  # neither the key nor the wrong one is logged
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stopped_server_frees_its_engine(make_server: Callable[..., Any]) -> None:
    # FastAPI memoizes endpoint callables process-wide: endpoints that closed over the engine client
    # kept every server's engine (KV cache, draft model) alive, 0.5 GiB each (the test process reached
    # 14 GB). The engine must go with its server.
    with make_server() as srv:
        ref = weakref.ref(srv.core)
        assert ref() is not None
    del srv
    gc.collect()
    assert ref() is None
