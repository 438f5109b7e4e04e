"""Hostile requests against both generation endpoints: each gets a 4xx in OpenAI's error shape, and after
the whole table the server is idle, its KV pool full, `/health` fine and greedy output unchanged.

The table is about requests a public server must refuse (outages, leaks, resource exhaustion); the
plain validation cases live in tests/server/api/test_server_errors.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer
from tests.server.api.test_server_errors import assert_openai_error

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
SLOW_TEMPLATE = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **fields}


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


# (id, path, body: a dict sent as JSON, or bytes sent as they are)
HOSTILE: list[tuple[str, str, Any]] = [
    # client templates and tokenizer options (item 1)
    ("kwarg-chat_template", CHAT, chat(chat_template_kwargs={"chat_template": SLOW_TEMPLATE})),
    ("field-chat_template", CHAT, chat(chat_template=SLOW_TEMPLATE)),
    ("kwarg-padding", CHAT, chat(chat_template_kwargs={"padding": "max_length", "max_length": 1000})),
    ("kwarg-tokenize", CHAT, chat(chat_template_kwargs={"tokenize": True})),
    ("kwarg-truncation", CHAT, chat(chat_template_kwargs={"truncation": True, "max_length": 2})),
    ("kwarg-return_tensors", CHAT, chat(chat_template_kwargs={"return_tensors": "np"})),
    ("kwarg-return_dict", CHAT, chat(chat_template_kwargs={"return_dict": True})),
    ("kwarg-return_assistant_tokens_mask", CHAT,
     chat(chat_template_kwargs={"return_assistant_tokens_mask": True})),
    ("kwarg-messages-override", CHAT, chat(chat_template_kwargs={"messages": [{"role": "user"}]})),
    ("tokenize-kwarg-chat_template", "/tokenize",
     {"messages": MSGS, "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}}),
    ("tokenize-kwarg-padding", "/tokenize",
     {"messages": MSGS, "chat_template_kwargs": {"padding": "max_length", "max_length": 1000}}),
    # stop strings (item 3)
    ("stop-5000", CHAT, chat(stop=["x"] * 5000)),
    ("stop-one-huge", COMP, comp(stop=["ab" * 40_000])),
    ("stop-many-long", COMP, comp(stop=[f"{i}" + "y" * 2000 for i in range(200)])),
    ("stop_token_ids-100k", COMP, comp(stop_token_ids=[1] * 100_000)),
    # text the tokenizer cannot take, ids out of range (item 5)
    ("surrogate-prompt", COMP, comp(prompt="\ud800")),
    ("surrogate-prompt-list", COMP, comp(prompt=["ok", "a\udfffb"])),
    ("surrogate-message", CHAT, chat(messages=[{"role": "user", "content": "x\ud800"}])),
    ("surrogate-part", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}])),
    ("surrogate-stop", COMP, comp(stop=["\ud800"])),
    ("tokenize-surrogate", "/tokenize", {"prompt": "\ud800"}),
    ("echo-negative-id", COMP, comp(prompt=[-1], echo=True)),
    ("echo-huge-id", COMP, comp(prompt=[2**40], echo=True)),
    ("nested-negative-id", COMP, comp(prompt=[[1, 2], [-5]])),
    ("ids-over-vocab-echo", COMP, comp(prompt=[[1], [10**7]], echo=True)),
    ("detokenize-huge-id", "/detokenize", {"tokens": [2**70]}),
    ("detokenize-over-vocab", "/detokenize", {"tokens": [10**7]}),
    # work one request can queue (items 2, 7)
    ("prompts-over-cap", COMP, comp(prompt=["a"] * 300)),
    ("prompts-times-n-over-cap", COMP, comp(prompt=["a"] * 30, n=10)),
    ("id-prompts-over-cap", COMP, comp(prompt=[[1]] * 300)),
    ("n-huge", CHAT, chat(n=10**6)),
    ("max_tokens-huge", CHAT, chat(max_tokens=10**9)),
    ("min_tokens-negative", COMP, comp(min_tokens=-1)),
    ("max_tokens-negative", COMP, comp(max_tokens=-5)),
    # numbers outside what the sampler takes
    ("seed-over-64-bits", COMP, comp(seed=2**70)),
    ("top_k-negative", COMP, comp(top_k=-7)),
    ("min_p-over-1", COMP, comp(min_p=1.5)),
    ("repetition_penalty-zero", COMP, comp(repetition_penalty=0)),
    ("frequency_penalty-over-2", CHAT, chat(frequency_penalty=3)),
    ("logprobs-negative", COMP, comp(logprobs=-1)),
    # per-tenant cache salt (item 6)
    ("cache_salt-empty", CHAT, chat(cache_salt="")),
    ("cache_salt-not-string", COMP, comp(cache_salt=123)),
    ("cache_salt-huge", COMP, comp(cache_salt="s" * 100_000)),
    # bodies a JSON parser chokes on
    ("json-nan-temperature", COMP, b'{"prompt": "Hello", "max_tokens": 4, "temperature": NaN}'),
    ("json-infinity-top_p", CHAT,
     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_p": Infinity}'),
    ("json-5000-digit-int", COMP, b'{"prompt": "Hello", "max_tokens": ' + b"1" * 5000 + b"}"),
    ("json-deep-nesting", COMP, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("json-invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 4}'),
    ("json-not-object", COMP, b'["prompt", "Hello"]'),
    ("wrong-types", CHAT, chat(stop={"a": 1})),
    ("mixed-prompt-types", COMP, comp(prompt=[1, "a"])),
    # more messages than OpenAI takes (each one costs validation time on the event loop)
    ("messages-2049", CHAT, chat(messages=[{"role": "user", "content": "x"}] * 2049)),
    ("tokenize-messages-2049", "/tokenize", {"messages": [{"role": "user", "content": "x"}] * 2049}),
    # a body over the default limit (2 MiB: its parse would hold the event loop)
    ("body-over-2MiB", COMP, comp(prompt=[[12345] * 2000] * 256)),
]


def _send(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    # json.dumps escapes lone surrogates as "\\udXXX" (valid JSON), which httpx's own encoder refuses
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"Content-Type": "application/json"})


def _greedy(client: httpx.Client) -> tuple[str, str]:
    a = client.post(CHAT, json=chat(temperature=0, max_tokens=12))
    b = client.post(COMP, json=comp(temperature=0, max_tokens=12, prompt="The capital of France is"))
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    return a.json()["choices"][0]["message"]["content"], b.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def hostile_server(make_server: Any) -> Any:
    """A server of its own, with its greedy answers taken before any hostile request (`.before`)."""
    with make_server() as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        srv.before = _greedy(client)
        yield srv


def test_table_has_forty_kinds_on_both_endpoints() -> None:
    assert len({name for name, *_ in HOSTILE}) == len(HOSTILE) >= 40
    assert {CHAT, COMP} <= {path for _, path, _ in HOSTILE}


@pytest.mark.parametrize(("name", "path", "body"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_is_4xx(hostile_server: RunningServer, name: str, path: str, body: Any) -> None:
    with httpx.Client(base_url=hostile_server.url, timeout=30) as client:
        resp = _send(client, path, body)
        assert 400 <= resp.status_code < 500, (name, resp.status_code, resp.text[:300])
        if resp.status_code != 413:  # the body-size guard answers before any JSON is read
            assert_openai_error(resp, resp.status_code)
        assert client.get("/health").status_code == 200


def test_server_unchanged_after_the_table(hostile_server: RunningServer) -> None:
    with httpx.Client(base_url=hostile_server.url, timeout=60) as client:
        for _name, path, body in HOSTILE:
            _send(client, path, body)
        assert client.get("/health").status_code == 200
        assert _greedy(client) == hostile_server.before
    assert hostile_server.idle()
