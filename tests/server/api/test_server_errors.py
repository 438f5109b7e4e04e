"""Every error case returns its status and the OpenAI error shape; the server keeps serving after them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None,
                        contains: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err["message"]
    return err


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **fields}


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


# (path, json body, expected param, text expected in the message)
BAD_REQUESTS = [
    (CHAT, {"model": MODEL}, "messages", "required"),
    (CHAT, chat(messages=[]), "messages", None),
    (CHAT, chat(bogus_field=1), "bogus_field", "unknown field"),
    (CHAT, chat(temperature="hot"), "temperature", None),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options", "stream"),
    (CHAT, chat(top_logprobs=2), "top_logprobs", "logprobs"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.0.content.0", "only text"),
    (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), "messages.0.tool_call_id", "tool_call_id"),
    (CHAT, chat(temperature=-1), "temperature", "temperature must be >= 0"),
    (CHAT, chat(top_p=0), "top_p", "top_p"),
    (CHAT, chat(max_tokens=0), "max_tokens", "max_tokens must be >= 1"),
    (CHAT, chat(logprobs=True, top_logprobs=50), "top_logprobs", "logprobs must be in"),
    (COMP, comp(logprobs=50), "logprobs", "logprobs must be in"),
    (CHAT, chat(presence_penalty=5), "presence_penalty", None),
    (CHAT, chat(stop_token_ids=[10**7]), "stop_token_ids", "outside the vocabulary"),
    (CHAT, chat(n=1000), "n", None),
    (CHAT, chat(logit_bias={"1": 5}), "logit_bias", "not supported"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice",
     "--enable-auto-tool-choice"),
    (CHAT, chat(max_tokens=4, max_completion_tokens=8), "max_completion_tokens", None),
    (COMP, {"model": MODEL}, "prompt", "required"),
    (COMP, comp(prompt=""), "prompt", "empty"),
    (COMP, comp(prompt=[]), "prompt", "empty"),
    (COMP, comp(prompt=[1, 2, 10**7]), "prompt", "out of vocabulary"),
    (COMP, comp(echo=True, logprobs=1), "echo", None),
    (COMP, comp(suffix="x"), "suffix", "not supported"),
    (COMP, comp(min_tokens=8, max_tokens=4), "min_tokens", None),
    (COMP, comp(stop=[""]), "stop", None),
    ("/tokenize", {"prompt": "a", "messages": MSGS}, "prompt", None),
    ("/detokenize", {"tokens": [-1]}, "tokens", None),
]


@pytest.mark.parametrize(("path", "body", "param", "contains"), BAD_REQUESTS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, *_rest) in enumerate(BAD_REQUESTS)])
def test_bad_request_is_400(server_url: str, path: str, body: dict, param: str | None,
                            contains: str | None) -> None:
    assert_openai_error(httpx.post(server_url + path, json=body), 400, param, contains)


def test_invalid_json_and_non_object_bodies(server_url: str) -> None:
    for raw in (b"{not json", b"", b"[1, 2]", b'"text"'):
        resp = httpx.post(server_url + CHAT, content=raw, headers={"Content-Type": "application/json"})
        assert_openai_error(resp, 400)
    resp = httpx.post(server_url + CHAT, content=b"{not json", headers={"Content-Type": "application/json"})
    assert "invalid JSON" in assert_openai_error(resp, 400)["message"]
    resp = httpx.post(server_url + CHAT, content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert "JSON object" in assert_openai_error(resp, 400)["message"]


def test_context_length_message_names_both_numbers(server: RunningServer) -> None:
    prompt = "hello " * 100
    n = len(httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"])
    resp = httpx.post(server.url + COMP, json=comp(prompt=prompt, max_tokens=2000))
    err = assert_openai_error(resp, 400, "max_tokens")
    assert err["message"] == (
        f"This model's maximum context length is 2048 tokens. However, you requested {n + 2000} tokens "
        f"({n} in the messages, 2000 in the completion). Please reduce the length of the messages or "
        f"completion.")
    assert err["code"] == "context_length_exceeded"
    too_long = httpx.post(server.url + COMP, json={"model": MODEL, "prompt": list(range(100, 2200))})
    assert_openai_error(too_long, 400, contains="2048")


def test_unknown_model_route_and_method(server_url: str) -> None:
    err = assert_openai_error(httpx.post(server_url + CHAT, json=chat(model="gpt-4")), 404, "model", "gpt-4")
    assert err["code"] == "model_not_found"
    assert_openai_error(httpx.post(server_url + COMP, json=comp(model="nope")), 404, "model")
    assert_openai_error(httpx.post(server_url + "/tokenize", json={"model": "nope", "prompt": "a"}), 404)
    assert_openai_error(httpx.get(server_url + "/v1/nothing-here"), 404)
    assert_openai_error(httpx.get(server_url + CHAT), 405)


def test_burst_of_bad_requests_then_correct_answer(server: RunningServer) -> None:
    bad = [(path, body) for path, body, _, _ in BAD_REQUESTS] * 3

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            responses = await asyncio.gather(*(c.post(p, json=b) for p, b in bad))
            good = await c.post(COMP, json=comp(prompt="The capital of France is", max_tokens=6,
                                                temperature=0))
        return responses, good

    responses, good = asyncio.run(run())
    assert [r.status_code for r in responses] == [400] * len(bad)
    assert good.status_code == 200
    assert good.json()["choices"][0]["text"].strip().startswith("Paris")
    assert server.idle()


def test_server_side_exception_is_500_and_server_keeps_serving(server: RunningServer,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    serving = server.app.state.serving

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("boom in the logprobs formatter")

    monkeypatch.setattr(serving, "chat_logprobs", broken)
    resp = httpx.post(server.url + CHAT, json=chat(logprobs=True, temperature=0), timeout=60)
    # The body names the request id, never the exception's text; the log has both.
    err = assert_openai_error(resp, 500, contains="request id chatcmpl-")
    assert err["code"] == "internal_error" and "boom" not in resp.text
    request_id = err["message"].rsplit(" ", 1)[-1]
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and "boom in the logprobs formatter" in str(logged[0].exc_info[1])
    with httpx.stream("POST", server.url + CHAT, json=chat(logprobs=True, stream=True), timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    message = json.loads(events[-2])["error"]["message"]
    assert "boom" not in message and json.loads(events[0])["id"] in message
    monkeypatch.undo()
    ok = httpx.post(server.url + CHAT, json=chat(logprobs=True, temperature=0), timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"]["content"]
    assert server.idle()


def test_engine_step_failure_fails_only_that_request(server: RunningServer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    runner = server.core.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", fail_once)
    resp = httpx.post(server.url + COMP, json=comp(temperature=0), timeout=60)
    err = assert_openai_error(resp, 500, contains="the forward pass failed")
    assert err["code"] == "engine_error" and "simulated kernel failure" not in err["message"]
    ok = httpx.post(server.url + COMP, json=comp(prompt="The capital of France is", temperature=0),
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert server.client.alive and server.idle()
    assert httpx.get(server.url + "/health").status_code == 200
