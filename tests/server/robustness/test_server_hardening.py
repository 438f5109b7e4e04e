"""Issue 34, items 1, 2 and 5: chat template kwargs and per-request templates, preprocessing off the event
loop with cheap limits first and bounded renders, and the status codes of malformed text and token ids."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.cli import build_parser
from server.cli.serve import resolve_settings
from server.serving import OpenAIServing
from server.settings import ServerSettings
from tests.conftest import RunningServer
from tests.server.api.test_server_errors import assert_openai_error

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "x"}]
# The template: 10^10 loop iterations.
FOREVER = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
TIMEOUT_S = 6.0  # --chat-template-timeout of the trusting server


@pytest.fixture(scope="module")
def trusting(make_server) -> Iterator[RunningServer]:  # noqa: ANN001
    with make_server(trust_request_chat_template=True, chat_template_timeout=TIMEOUT_S,
                     default_chat_template_kwargs={"greeting": "Hello"}) as srv:
        yield srv


def _post(srv: RunningServer, path: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=timeout)


def _raw_post(srv: RunningServer, path: str, body: str) -> httpx.Response:
    """A JSON body as written: `\\ud800` stays an escape (valid JSON for a lone surrogate)."""
    return httpx.post(srv.url + path, content=body.encode(), headers={"Content-Type": "application/json"},
                      timeout=60)


def _text_of(srv: RunningServer, tokens: list[int]) -> str:
    return srv.core.tokenizer.decode(tokens, skip_special_tokens=False)


# -- item 1: chat_template_kwargs and per-request templates ----------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"padding": "max_length", "max_length": 3000}, {"tokenize": False}, {"truncation": True},
    {"return_dict": True}, {"return_assistant_tokens_mask": True}, {"tokenizer_kwargs": {}},
    {"messages": []}, {"add_generation_prompt": False}, {"bos_token": "x"}, {"eos_token": "x"},
])
def test_kwargs_never_set_tokenizer_options_or_server_variables(server: RunningServer,
                                                                 kwargs: dict[str, Any]) -> None:
    first = next(iter(kwargs))
    for path, extra in ((CHAT, {"max_tokens": 2}), ("/tokenize", {})):
        resp = _post(server, path, {"messages": MSGS, "chat_template_kwargs": kwargs, **extra})
        assert_openai_error(resp, 400, param=f"chat_template_kwargs.{first}", contains=first)
    assert server.idle()


def test_request_templates_refused_unless_trusted(server: RunningServer) -> None:
    template = "{{ 'chosen by the client' }}"
    resp = _post(server, CHAT, {"messages": MSGS, "max_tokens": 2, "chat_template": template})
    assert_openai_error(resp, 400, param="chat_template", contains="--trust-request-chat-template")
    for path in (CHAT, "/tokenize"):
        resp = _post(server, path, {"messages": MSGS, "chat_template_kwargs": {"chat_template": template}})
        assert_openai_error(resp, 400, param="chat_template_kwargs.chat_template",
                            contains="--trust-request-chat-template")
    # Variables the model's template does not read are dropped (vLLM does the same): the prompt is unchanged.
    plain = _post(server, "/tokenize", {"messages": MSGS}).json()["tokens"]
    extra = _post(server, "/tokenize", {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": True}})
    assert extra.status_code == 200 and extra.json()["tokens"] == plain
    assert server.idle()


def test_trusted_request_template_reads_its_variables(trusting: RunningServer) -> None:
    template = "{{ greeting }}, {{ messages[0]['content'] }}{{ suffix }}"

    def rendered(**fields: Any) -> str:
        resp = _post(trusting, "/tokenize", {"messages": MSGS, **fields})
        assert resp.status_code == 200, resp.text
        return _text_of(trusting, resp.json()["tokens"])

    # --default-chat-template-kwargs fills `greeting`; the request's kwargs win over it.
    assert rendered(chat_template=template) == "Hello, x"
    kwargs = {"suffix": "!", "greeting": "Hi"}
    assert rendered(chat_template=template, chat_template_kwargs=kwargs) == "Hi, x!"
    assert rendered(chat_template_kwargs={"chat_template": template, "unread": 1}) == "Hello, x"
    # The model's own template does not read `greeting`: the default leaves its prompt alone.
    expected = trusting.core.tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    assert rendered() == expected
    bad = _post(trusting, "/tokenize", {"messages": MSGS, "chat_template": "{% for %}"})
    assert_openai_error(bad, 400, param="chat_template", contains="not valid Jinja")
    bad = _post(trusting, "/tokenize", {"messages": MSGS, "chat_template": template,
                                        "chat_template_kwargs": {"padding": True}})
    assert_openai_error(bad, 400, param="chat_template_kwargs.padding")
    chat = _post(trusting, CHAT, {"messages": MSGS, "max_tokens": 2, "chat_template": template})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(
        trusting.core.tokenizer.encode("Hello, x", add_special_tokens=False))
    assert trusting.idle()


def test_default_chat_template_kwargs_flag(server: RunningServer) -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}',
                              "--trust-request-chat-template"])
    settings = resolve_settings(args, environ={})
    assert settings.default_chat_template_kwargs == {"enable_thinking": False}
    assert settings.trust_request_chat_template
    with pytest.raises(ValueError, match="--default-chat-template-kwargs is not valid JSON"):
        resolve_settings(parser.parse_args(["serve", "--default-chat-template-kwargs", "{nope"]), environ={})
    # A default that names a tokenizer option is a startup error, not a silent no-op.
    with pytest.raises(ValueError, match="`padding`"):
        OpenAIServing(server.client, ServerSettings(default_chat_template_kwargs={"padding": 1}))


def test_sandbox_renders_like_transformers(server: RunningServer) -> None:
    tokenizer = server.core.tokenizer
    chats = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": " spaced  "}, {"role": "assistant", "content": "Hello "}],
        [{"role": "developer", "content": "d"}, {"role": "user", "content": "🌊\n"}],
    ]
    for messages in chats:
        reference = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        for generation, cont in ((True, False), (False, False), (False, True)):
            if cont and messages[-1]["role"] != "assistant":
                continue
            resp = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": generation,
                                               "continue_final_message": cont})
            expected = tokenizer.apply_chat_template(reference, add_generation_prompt=generation,
                                                     continue_final_message=cont, tokenize=True,
                                                     return_dict=False)
            assert resp.json()["tokens"] == expected, (messages, generation, cont)


# -- item 2: off the event loop, cheap limits first, bounded renders -------------------------------

def test_health_and_requests_answered_during_a_slow_render(trusting: RunningServer) -> None:
    """A render that would run for ever holds one preprocessing thread until its time limit; meanwhile
    the event loop and the other thread keep answering."""
    slow: dict[str, Any] = {}

    def send_slow() -> None:
        t0 = time.monotonic()
        slow["resp"] = _post(trusting, CHAT, {"messages": MSGS, "max_tokens": 2, "chat_template": FOREVER})
        slow["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=send_slow)
    thread.start()
    time.sleep(1.0)  # the render is under way
    health = httpx.get(trusting.url + "/health", timeout=5)
    models = httpx.get(trusting.url + "/v1/models", timeout=5)
    tokenized = _post(trusting, "/tokenize", {"messages": MSGS}, timeout=5)  # on the other thread
    assert thread.is_alive(), "the slow render should still be running"
    assert health.status_code == 200 and models.status_code == 200 and tokenized.status_code == 200
    thread.join(60)
    err = assert_openai_error(slow["resp"], 400, param="messages", contains="--chat-template-timeout")
    assert err["code"] == "chat_template_limit" and slow["seconds"] >= TIMEOUT_S
    assert trusting.idle()


@pytest.mark.parametrize(("template", "contains"), [
    # a string doubled 60 times, through `~` and through `+`
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "--max-prompt-chars"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "--max-prompt-chars"),
    ("{{ 'x' * 10 ** 9 }}", "--max-prompt-chars"),
    ("{{ 7 ** (10 ** 9) }}", "too large"),
    ("{% macro m() %}{% for i in range(99999) %}{{ i }}{% endfor %}{% endmacro %}"
     "{% for i in range(99999) %}{{ m() }}{% endfor %}", "--max-prompt-chars"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{{ messages.__class__.__mro__ }}", "unsafe"),
])
def test_render_limits(trusting: RunningServer, template: str, contains: str) -> None:
    t0 = time.monotonic()
    resp = _post(trusting, "/tokenize", {"messages": MSGS, "chat_template": template})
    assert_openai_error(resp, 400, param="messages", contains=contains)
    assert time.monotonic() - t0 < TIMEOUT_S  # stopped by a size check, not the clock
    assert httpx.get(trusting.url + "/health").status_code == 200


def test_cheap_limits_come_before_tokenizing(make_server) -> None:  # noqa: ANN001
    with make_server(max_prompt_chars=1000, max_model_len=256, kv_cache_memory="64MiB") as srv:
        # The choice count is checked before any prompt is tokenized (the last one could not be).
        resp = _raw_post(srv, COMP, '{"prompt": [' + '"a", ' * 200 + '"\\ud800"], "n": 2}')
        assert_openai_error(resp, 400, param="n", contains="too many choices")
        long = "word " * 201
        err = assert_openai_error(_post(srv, COMP, {"prompt": long}), 400, param="prompt", contains="1000")
        assert err["code"] == "prompt_too_long"
        err = assert_openai_error(_post(srv, COMP, {"prompt": ["ok", long]}), 400, param="prompt")
        assert err["code"] == "prompt_too_long"
        for path in (CHAT, "/tokenize"):
            resp = _post(srv, path, {"messages": [{"role": "user", "content": long}]})
            assert assert_openai_error(resp, 400, param="messages")["code"] == "prompt_too_long"
            resp = _post(srv, path, {"messages": MSGS * 257})
            assert_openai_error(resp, 400, param="messages", contains="max_model_len=256")
        assert_openai_error(_post(srv, "/tokenize", {"prompt": long}), 400, param="prompt")
        assert_openai_error(_post(srv, "/detokenize", {"tokens": [1] * 257}), 400, param="tokens")
        assert _post(srv, COMP, {"prompt": "word " * 199, "max_tokens": 1}).status_code == 200
        assert srv.idle()


def test_default_prompt_char_limit_is_what_the_context_can_hold(server: RunningServer) -> None:
    tokenizer = server.core.tokenizer
    longest = max(len(t) for t in tokenizer.get_vocab())
    limit = server.app.state.serving.max_prompt_chars
    assert limit == server.client.max_model_len * longest
    resp = _post(server, COMP, {"prompt": "a" * (limit + 1)})
    assert assert_openai_error(resp, 400, param="prompt")["code"] == "prompt_too_long"
    # At the limit the text is tokenized; this one has too many tokens for the context.
    resp = _post(server, COMP, {"prompt": "a " * (limit // 2)})
    assert assert_openai_error(resp, 400)["code"] == "context_length_exceeded"


# -- item 5: status codes ---------------------------------------------------------------------------

def test_lone_surrogates_are_400(server: RunningServer) -> None:
    cases = [
        (COMP, '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
        (COMP, '{"prompt": ["fine", "a\\udfffb"], "max_tokens": 2}', "prompt"),
        (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages"),
        (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
         "messages"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
        ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ]
    for path, body, param in cases:
        assert_openai_error(_raw_post(server, path, body), 400, param=param, contains="surrogate")
    # Error messages that quote the request stay encodable.
    assert_openai_error(_raw_post(server, COMP, '{"prompt": "hi", "\\ud800": 1}'), 400)
    resp = _raw_post(server, COMP, '{"prompt": "hi", "model": "m\\ud800"}')
    assert_openai_error(resp, 404, param="model", contains="m\\ud800")
    resp = _raw_post(server, "/tokenize", '{"messages": [{"role": "user", "content": "x"}], '
                                          '"chat_template_kwargs": {"return_\\udfff": 1}}')
    assert_openai_error(resp, 400, param="chat_template_kwargs.return_\\udfff")
    assert httpx.get(server.url + "/health").status_code == 200 and server.idle()


@pytest.mark.parametrize("stream", [False, True])
def test_out_of_range_token_ids_are_400_before_decoding(server: RunningServer, stream: bool) -> None:
    vocab = server.core.loaded.vocab_size
    for prompt in ([-1], [vocab], [1, 2, 2**62], [[5, 6], [-5]]):
        resp = _post(server, COMP, {"prompt": prompt, "echo": True, "max_tokens": 2, "stream": stream})
        assert_openai_error(resp, 400, param="prompt", contains="out of vocabulary")
    assert_openai_error(_post(server, "/detokenize", {"tokens": [1, vocab]}), 400, param="tokens")
    prompts = [[5, 6], [vocab - 1]]
    ok = _post(server, COMP, {"prompt": prompts, "echo": True, "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200
    for choice, prompt in zip(ok.json()["choices"], prompts, strict=True):
        assert choice["text"].startswith(_text_of(server, prompt))
    assert server.idle()


def test_unexpected_error_body_names_the_request_id_only(server: RunningServer,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    serving = server.app.state.serving

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("secret path /home/someone/model and another request's text")

    monkeypatch.setattr(serving.tokens, "decode_many", broken)
    for path, body in (("/detokenize", {"tokens": [1, 2]}),
                       (COMP, {"prompt": [1, 2], "echo": True, "max_tokens": 1})):
        resp = _post(server, path, body)
        err = assert_openai_error(resp, 500, contains="request id ")
        assert err["code"] == "internal_error" and "secret" not in resp.text
        request_id = err["message"].rsplit(" ", 1)[-1]
        logged = [r for r in caplog.records if request_id in r.getMessage()]
        assert logged and "secret path" in str(logged[0].exc_info[1])
    monkeypatch.undo()
    assert _post(server, "/detokenize", {"tokens": [1, 2]}).status_code == 200
    assert server.idle()


# -- the benchmark of item 2 ------------------------------------------------------------------------

def test_bench_health_runs_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "bench_health.json"
    cmd = [sys.executable, "-m", "tools.bench_health", "--seconds", "2", "--idle-seconds", "0.5",
           "--clients", "2", "--kinds", "tokenize_text,detokenize", "--max-model-len", "256",
           "--kv-cache-memory", "64MiB", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "/health under load" in proc.stdout
    report = json.loads(out.read_text())
    assert report["limits"]["max_model_len"] == 256
    assert report["limits"]["max_prompt_chars"] == 256 * report["limits"]["longest_token_chars"]
    kinds = report["kinds"]
    assert set(kinds) == {"tokenize_text", "detokenize"}
    assert all(k["finished"] >= 1 and k["ok"] == k["finished"] for k in kinds.values()), kinds
    assert report["health"]["n"] >= 1 and report["health"]["p99_ms"] >= report["health"]["p50_ms"]


def test_batch_decode_equals_the_tokenizers_own(server: RunningServer) -> None:
    """Echo and /detokenize decode through the Rust batch decode (it lets go of the GIL); the texts must
    be transformers' own, special tokens and ids that split a UTF-8 character included."""
    from server.tokens import TokenText

    tok = server.core.tokenizer
    text = "Grüße, 東京! <|im_start|>user\n🙂 x"
    ids = tok.encode(text, add_special_tokens=False)
    prompts = [ids, ids[:3], ids[1:-1], [tok.eos_token_id, 5, 6], []]
    tt = TokenText(tok, 1 << 20)
    for skip in (False, True):
        assert tt.decode_many(prompts, skip) == [tok.decode(p, skip_special_tokens=skip) for p in prompts]
        assert tt.decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)
