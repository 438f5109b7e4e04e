"""A server with an API key, served-model aliases, a small body limit and a tiny waiting queue."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import RunningServer
from tests.server.api.test_server_errors import assert_openai_error
from tests.server.monitoring.test_server_metrics import scrape, wait_for

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def limited(make_server) -> Iterator[RunningServer]:  # noqa: ANN001
    with make_server(api_key=KEY, served_model_name=["smol", "alias"], max_request_body_size=BODY_LIMIT,
                     max_num_seqs=1, max_waiting_requests=1, max_model_len=512,
                     kv_cache_memory="64MiB") as srv:
        yield srv


def chat_body(**fields: object) -> dict:
    return {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def test_api_key_required_except_health_and_metrics(limited: RunningServer) -> None:
    url = limited.url
    for path in ("/v1/models", "/version", "/tokenize"):
        method = "POST" if path == "/tokenize" else "GET"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": "Basic x"}):
            resp = httpx.request(method, url + path, headers=headers, json={"prompt": "a"})
            err = assert_openai_error(resp, 401)
            assert err["code"] == "invalid_api_key"
            assert resp.headers["www-authenticate"] == "Bearer"
    assert_openai_error(httpx.post(url + "/v1/chat/completions", json=chat_body()), 401)
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    assert httpx.get(url + "/version", headers=AUTH).status_code == 200


def test_openai_sdk_with_and_without_key(limited: RunningServer) -> None:
    good = openai.OpenAI(base_url=limited.base_url, api_key=KEY, max_retries=0)
    resp = good.chat.completions.create(model="alias", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=4, temperature=0)
    assert resp.model == "alias" and resp.choices[0].message.content
    bad = openai.OpenAI(base_url=limited.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_served_model_names(limited: RunningServer) -> None:
    models = httpx.get(limited.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["smol", "alias"]
    assert models["data"][0]["max_model_len"] == 512
    resp = httpx.post(limited.url + "/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["model"] == "smol"  # no `model`: the first name
    real = httpx.post(limited.url + "/v1/chat/completions", headers=AUTH,
                      json=chat_body(model="SmolLM2-135M-Instruct"))
    assert_openai_error(real, 404, "model")


def test_body_over_limit_is_413(limited: RunningServer) -> None:
    big = chat_body(messages=[{"role": "user", "content": "x" * (BODY_LIMIT + 10)}])
    resp = httpx.post(limited.url + "/v1/chat/completions", headers=AUTH, json=big)
    assert assert_openai_error(resp, 413)["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"model": "smol", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    headers = {**AUTH, "Content-Type": "application/json"}
    resp = httpx.post(limited.url + "/v1/chat/completions", headers=headers, content=chunked())
    assert_openai_error(resp, 413)
    ok = httpx.post(limited.url + "/v1/chat/completions", headers=AUTH, json=chat_body(temperature=0))
    assert ok.status_code == 200


def _read_first_event(lines: Iterator[str]) -> str:
    # A plain loop: closing a generator over `lines` would close the connection (and abort the request).
    for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("the stream ended without an event")


def test_full_waiting_queue_is_503(limited: RunningServer) -> None:
    long = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=limited.url, headers=AUTH, timeout=60) as c1, \
            httpx.Client(base_url=limited.url, headers=AUTH, timeout=60) as c2, \
            c1.stream("POST", "/v1/completions", json=long) as first:
        first_lines = first.iter_lines()
        _read_first_event(first_lines)  # the first request is running
        with c2.stream("POST", "/v1/completions", json=long) as second:
            assert second.status_code == 200
            # max_num_seqs=1: the second waits behind the first
            wait_for(lambda: len(limited.core.scheduler.waiting) == 1, timeout=5)
            third = httpx.post(limited.url + "/v1/completions", headers=AUTH, json={**long, "stream": False})
            err = assert_openai_error(third, 503)
            assert err["code"] == "server_overloaded" and third.headers["retry-after"] == "1"
            assert len(limited.core.scheduler.running) == 1
    wait_for(limited.idle, timeout=2)
    ok = httpx.post(limited.url + "/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200
    assert scrape(limited.url)[("vllm:num_requests_waiting", (("model_name", "smol"),))] == 0


def test_health_is_503_once_the_engine_stops(limited: RunningServer) -> None:
    # Last test of the module: it stops this server's engine thread.
    assert httpx.get(limited.url + "/health").status_code == 200
    limited.client.shutdown()
    deadline = time.monotonic() + 5
    while limited.client.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert_openai_error(httpx.get(limited.url + "/health"), 503)
    resp = httpx.post(limited.url + "/v1/chat/completions", headers=AUTH, json=chat_body())
    assert_openai_error(resp, 503)
