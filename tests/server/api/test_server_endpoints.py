"""/health, /version, /v1/models, /tokenize + /detokenize on the shared server."""

from __future__ import annotations

import httpx

import engine
from tests.conftest import RunningServer

MODEL = "SmolLM2-135M-Instruct"


def test_health_version_models(server: RunningServer) -> None:
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(server.url + "/version").json() == {"version": engine.__version__}
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 2048
    assert card["owned_by"] and isinstance(card["created"], int)


def test_tokenize_detokenize_round_trip(server: RunningServer) -> None:
    text = "Hello world! Tokenizers split text 🌊 into ids."
    tok = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tok["tokens"] == server.core.tokenizer.encode(text, add_special_tokens=True)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 2048
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
    assert back == {"prompt": text}
    body = {"prompt": "Hello world", "return_token_strs": True}
    strs = httpx.post(server.url + "/tokenize", json=body).json()
    assert strs["token_strs"] == ["Hello", "Ġworld"]


def test_tokenize_messages_matches_chat_prompt(server: RunningServer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    tok = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    expected = server.core.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == expected
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                      timeout=60).json()
    assert chat["usage"]["prompt_tokens"] == tok["count"]
