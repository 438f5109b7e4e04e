"""Structured outputs through the `openai` SDK against a real server (real engine, default model): JSON
schemas, json_object, regex, choice and grammars by every field that asks for them (OpenAI's
response_format, vLLM's structured_outputs and guided_*), greedy and sampled, with speculation off, ngram and
MTP. Every answer parses and validates; constrained greedy is the same with and without speculation; bad
grammars get a 400 naming the problem and leave the server healthy."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import RunningServer

MODEL = "SmolLM2-135M-Instruct"
ASSISTANT = str(Path(__file__).parents[3] / "configs" / "assistants" / "smollm2-135m-mtp")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]}}, "required": ["name", "age", "city"],
    "additionalProperties": False}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Describe Alice, 30, from Paris.", PERSON),
    ("Describe a person from Tokyo.", PERSON),
    ("Give a product with a price.", {"type": "object", "properties": {
        "product": {"type": "string", "maxLength": 40},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "in_stock": {"type": "boolean"}}, "required": ["product", "price", "in_stock"]}),
    ("List three colours.", {"type": "object", "properties": {"colours": {
        "type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 3, "maxItems": 3}},
        "required": ["colours"]}),
    ("Rate this film from 1 to 5: 'a masterpiece'.", {"type": "object", "properties": {
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "sentiment": {"enum": ["positive", "negative", "neutral"]}}, "required": ["rating", "sentiment"]}),
    ("A book with its author.", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 50},
        "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                                    "last": {"type": "string", "maxLength": 20}},
                   "required": ["first", "last"], "additionalProperties": False},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title", "author", "year"]}),
    ("Two cities and their countries.", {"type": "object", "properties": {"cities": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                             "country": {"type": "string", "maxLength": 20}},
            "required": ["city", "country"], "additionalProperties": False}}}, "required": ["cities"]}),
    ("The weather today.", {"type": "object", "properties": {
        "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
        "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
        "required": ["temperature_c", "condition"]}),
    ("Is 7 a prime number?", {"type": "object", "properties": {
        "answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 60}},
        "required": ["answer", "reason"]}),
    ("A to-do list of two items.", {"type": "object", "properties": {"todo": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "task": {"type": "string", "maxLength": 30}, "done": {"type": "boolean"}},
            "required": ["task", "done"]}}}, "required": ["todo"]}),
]


def _strict(schema: Any) -> Any:
    """OpenAI's strict mode: every object closed (the model cannot wander off into keys of its own)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out
    return schema


SCHEMAS = [(q, _strict(s)) for q, s in SCHEMAS]
SCHEMAS = SCHEMAS + [(f"Again: {q}", s) for q, s in SCHEMAS]  # 20 requests


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question} Answer in JSON."}]


def _ask_all(base_url: str, temperature: float) -> list[str]:
    """The 20 schema requests at once (batched in the engine); each answer's text."""
    return asyncio.run(_ask(base_url, temperature))


async def _ask(base_url: str, temperature: float) -> list[str]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
    calls = [client.chat.completions.create(
        model=MODEL, messages=_messages(q), max_tokens=300, temperature=temperature, seed=i,
        response_format={"type": "json_schema",
                         "json_schema": {"name": f"s{i}", "schema": s, "strict": True}})
        for i, (q, s) in enumerate(SCHEMAS)]
    responses = await asyncio.gather(*calls)
    await client.close()
    assert all(r.choices[0].finish_reason == "stop" for r in responses)  # the grammar ended each one
    return [r.choices[0].message.content for r in responses]


def _check_all(texts: list[str]) -> None:
    for text, (_, schema) in zip(texts, SCHEMAS, strict=True):
        jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def plain_greedy(server: RunningServer) -> list[str]:
    return _ask_all(server.base_url, 0.0)


@pytest.mark.parametrize("spec", [None, "ngram", "mtp"])
def test_json_schemas_validate_greedy_and_sampled(spec: str | None, make_server, server: RunningServer,
                                                  plain_greedy: list[str]) -> None:
    _check_all(plain_greedy)
    config = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 4},
              "mtp": {"method": "mtp", "model": ASSISTANT, "num_speculative_tokens": 2}}.get(spec or "")

    def run(srv: RunningServer) -> tuple[list[str], list[str]]:
        return _ask_all(srv.base_url, 0.0), _ask_all(srv.base_url, 0.8)

    if config is None:
        greedy, sampled = run(server)
        assert server.idle() and not server.core.structured.matchers
    else:
        with make_server(speculative_config=config) as srv:
            greedy, sampled = run(srv)
            assert srv.idle() and not srv.core.structured.matchers
            metrics = httpx.get(srv.url + "/metrics", timeout=30).text
            drafted = re.search(r"^vllm:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)", metrics, re.M)
            assert drafted and float(drafted.group(1)) > 0
    _check_all(greedy)
    _check_all(sampled)
    assert greedy == plain_greedy  # constrained greedy is the same with and without speculation
    assert sampled != greedy  # sampling did sample


def test_each_field_and_kind(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)

    def chat(max_tokens: int = 40, **extra: Any) -> str:
        r = client.chat.completions.create(model=MODEL, messages=_messages("Pick one."),
                                           max_tokens=max_tokens, temperature=0, **extra)
        return r.choices[0].message.content or ""

    # Any JSON object (it may run past max_tokens: then it is one as far as it got).
    r = client.chat.completions.create(model=MODEL, messages=_messages("Describe a cat."), max_tokens=200,
                                       temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content or ""
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    colours = ["red", "green", "blue"]
    assert chat(extra_body={"structured_outputs": {"choice": colours}}) in colours
    assert chat(extra_body={"guided_choice": ["yes", "no"]}) in ("yes", "no")
    assert re.fullmatch(r"\d{3}-\d{4}", chat(extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}}))
    email = r"[a-z]{2,8}@[a-z]{2,8}\.com"
    assert re.fullmatch(email, chat(extra_body={"guided_regex": email}))
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", chat(extra_body={"guided_grammar": lark}))
    gbnf = 'root ::= "x" [0-9] [0-9]'
    assert re.fullmatch(r"x[0-9]{2}", chat(extra_body={"structured_outputs": {"grammar": gbnf}}))
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    assert isinstance(json.loads(chat(extra_body={"guided_json": schema}))["ok"], bool)
    # /v1/completions takes them too, and streaming returns the same text.
    comp = client.completions.create(model=MODEL, prompt="The colour of the sky:", max_tokens=10,
                                     temperature=0, extra_body={"guided_choice": ["blue sky", "grey sky"]})
    assert comp.choices[0].text in ("blue sky", "grey sky") and comp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=_messages("Describe Alice."), max_tokens=80, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}))
    whole = chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    jsonschema.validate(json.loads(streamed), PERSON)
    assert streamed == client.chat.completions.create(
        model=MODEL, messages=_messages("Describe Alice."), max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    ).choices[0].message.content
    assert whole
    # vLLM's disable_any_whitespace beside response_format: compact JSON, still valid.
    compact = chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                   extra_body={"structured_outputs": {"disable_any_whitespace": True}}, max_tokens=80)
    data = json.loads(compact)
    jsonschema.validate(data, PERSON)
    assert compact == json.dumps(data, separators=(",", ":"), ensure_ascii=False) and "\n" in whole
    assert server.idle() and not server.core.structured.matchers


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "nonsense"}}}},
     "response_format", "Invalid type: nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}},
     "response_format", "minimum (5) is greater than maximum"),
    ({"structured_outputs": {"regex": "a{3"}}, "structured_outputs", "unclosed counted repetition"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"whitespace": "x"}}, "structured_outputs.whitespace", "not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "send one of"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "not supported"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
])
def test_bad_grammars_are_400s_and_the_server_stays_healthy(server: RunningServer, body: dict[str, Any],
                                                            param: str, message: str) -> None:
    payload = {"model": MODEL, "messages": _messages("hi"), "max_tokens": 5, **body}
    r = httpx.post(f"{server.base_url}/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    ok = httpx.post(f"{server.base_url}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": _messages("hi"), "max_tokens": 5,
        "response_format": {"type": "json_object"}})
    assert ok.status_code == 200 and server.idle()
