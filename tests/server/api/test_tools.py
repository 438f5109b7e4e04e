"""Tool calling and reasoning output, OpenAI-shaped: parsers on recorded outputs of each format (malformed
ones fall back to plain content), streamed deltas that reassemble to the whole answer, and through the
`openai` SDK against a real server with the shipped SmolLM2 template: `required` and named functions
(grammar-constrained, so the arguments validate), `auto` reading a call the model wrote, a conversation
that carries the tool's answer, and the 400s."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from server.tools import (
    MAX_PARALLEL_CALLS,
    PARSERS,
    ChatOutput,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    Qwen3ReasoningParser,
    forced_schema,
)
from tests.conftest import RunningServer

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]

# Recorded outputs: (parser, text, expected content, expected [(name, arguments object)]).
RECORDED = [
    ("hermes",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris", "unit": "C"})]),
    ("hermes", 'Checking both.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>',
     "Checking both.", [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1,',
     '<tool_call>\n{"name": "add", "arguments": {"a": 1,', []),  # cut short: plain content
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>',
     '<tool_call>\n{"arguments": {}}\n</tool_call>', []),  # no name: plain content
    ("hermes", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', None,
     [("add", {"a": 1, "b": 2})]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": '
     '{"city": "Oslo", "unit": "F"}}', None, [("add", {"a": 1, "b": 2}),
                                              ("get_weather", {"city": "Oslo", "unit": "F"})]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', []),
    ("llama3_json", "The answer is {4}.", "The answer is {4}.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 5, "b": 6}}]', None,
     [("add", {"a": 5, "b": 6})]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}, '
     '{"name": "add", "arguments": {"a": 0, "b": 0}}]', "Sure.",
     [("get_weather", {"city": "Rome", "unit": "C"}), ("add", {"a": 0, "b": 0})]),
    ("mistral", "[TOOL_CALLS] [{\"name\": 7}]", "[TOOL_CALLS] [{\"name\": 7}]", []),
]


def _streamed(shape: ChatOutput, text: str, seed: int,
              finish: str = "stop") -> tuple[str, str, list[tuple[str, str]], str | None]:
    rng = random.Random(seed)
    reasoning = content = ""
    i = 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 7))
        d = shape.feed(text[i:j])
        reasoning, content, i = reasoning + d.reasoning, content + d.content, j
    end = shape.finish(finish)
    calls = [(c.name, c.arguments) for c in end.calls or []]
    return reasoning + end.reasoning, content + end.content, calls, end.finish_reason


@pytest.mark.parametrize("case", range(len(RECORDED)))
def test_parsers_on_recorded_outputs_and_streaming_reassembles(case: int) -> None:
    name, text, content, calls = RECORDED[case]
    parser = PARSERS[name]()
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    reasoning, whole, whole_calls, finish = ChatOutput("auto", parser, None).whole(text, "stop")
    assert reasoning is None and finish == ("tool_calls" if calls else "stop")
    for seed in range(10):  # any split of the stream gives the same answer
        r, c, cs, f = _streamed(ChatOutput("auto", parser, None), text, seed)
        assert (c or None, cs, f) == (whole, [(x.name, x.arguments) for x in whole_calls], finish)


_PARIS = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'
_ADD = '{"name": "add", "parameters": {"a": 1, "b": 2}}'


@pytest.mark.parametrize("text, finish, calls, want_finish", [
    (f"[{_PARIS}, {_ADD}]", "stop", ["get_weather", "add"], "tool_calls"),
    (f"[{_PARIS}, {_PARIS}, {_ADD}, {_PARIS}]", "stop", ["get_weather", "add"], "tool_calls"),  # once each
    (f"[{_PARIS}, {_ADD}, {_PARIS[:30]}", "length", ["get_weather", "add"], "tool_calls"),  # cut: calls kept
    (f"[{_PARIS}, ", "length", ["get_weather"], "tool_calls"),
    (f"[{_PARIS}", "length", ["get_weather"], "tool_calls"),
    (f"[\n  {_PARIS}\n,\n{_ADD[:-1]}", "length", ["get_weather"], "tool_calls"),
    (f"[{_PARIS[:-3]}", "length", [], "length"),  # no call complete: the text as content
])
def test_required_list_whole_or_cut_short_gives_its_calls(text: str, finish: str, calls: list[str],
                                                          want_finish: str) -> None:
    _, content, got, got_finish = ChatOutput("required", None, None).whole(text, finish)
    assert [c.name for c in got] == calls and got_finish == want_finish
    assert content == (None if calls else text)
    for c in got:
        assert json.loads(c.arguments) in ({"city": "Paris", "unit": "C"}, {"a": 1, "b": 2})
    for seed in range(5):
        _, sc, scalls, sf = _streamed(ChatOutput("required", None, None), text, seed, finish)
        assert (sc or None, scalls, sf) == (content, [(c.name, c.arguments) for c in got], want_finish)


def test_forced_schema_bounds_the_list_and_writes_compact_json() -> None:
    one, many = forced_schema(TOOLS, "required", False), forced_schema(TOOLS, "required", True)
    assert (one["minItems"], one["maxItems"]) == (1, 1)
    assert (many["minItems"], many["maxItems"]) == (1, MAX_PARALLEL_CALLS)
    named = forced_schema(TOOLS, "get_weather", True)
    assert named["x-guidance"]["whitespace_flexible"] is False and "x-guidance" not in WEATHER
    assert {k: v for k, v in named.items() if k != "x-guidance"} == WEATHER


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4.", "First, 2 + 2.", "It is 4."),
    ("  <think>only thinking", "only thinking", None),
    ("No thoughts, just 4.", None, "No thoughts, just 4."),
    ("<thin", None, "<thin"),
])
def test_reasoning_split_whole_and_streamed(text: str, reasoning: str | None, content: str | None) -> None:
    parser = Qwen3ReasoningParser()
    r, c, calls, _ = ChatOutput(None, None, parser).whole(text, "stop")
    assert (r, c or None, calls) == (reasoning, content, [])
    for seed in range(10):
        sr, sc, _, _ = _streamed(ChatOutput(None, None, parser), text, seed)
        assert (sr or None, sc or None) == (reasoning or None, content)
    assert ChatOutput(None, None, None).whole(text, "stop")[:2] == (None, text)  # without a parser: as is


@pytest.fixture(scope="module")
def tool_server(make_server) -> RunningServer:  # noqa: ANN001
    settings = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes", "reasoning_parser": "qwen3"}
    with make_server(**settings) as srv:
        yield srv


def _client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)


def _ask(srv: RunningServer, stream: bool = False, **kw: Any) -> dict[str, Any]:
    """One chat completion as a dict {content, reasoning, tool_calls, finish_reason}, streamed or not."""
    kw.setdefault("messages", [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}])
    kw.setdefault("max_tokens", 80)
    kw.setdefault("tools", TOOLS)
    client = _client(srv)
    if not stream:
        r = client.chat.completions.create(model=MODEL, temperature=0, **kw)
        m = r.choices[0].message
        return {"content": m.content, "reasoning": getattr(m, "reasoning_content", None),
                "tool_calls": [(c.function.name, c.function.arguments) for c in m.tool_calls or []],
                "finish_reason": r.choices[0].finish_reason}
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kw):
        d = chunk.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for c in d.tool_calls or []:
            name, args = calls.get(c.index, ("", ""))
            calls[c.index] = (name + (c.function.name or ""), args + (c.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None,
            "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def test_required_and_named_calls_validate_and_stream_the_same(tool_server: RunningServer) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole = _ask(tool_server, tool_choice=choice, parallel_tool_calls=False)
        assert whole["finish_reason"] == "tool_calls" and whole["content"] is None, whole
        (name, args), = whole["tool_calls"]
        assert name in ("get_weather", "add")
        tool = next(t for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(args), tool["function"]["parameters"])
        assert _ask(tool_server, stream=True, tool_choice=choice, parallel_tool_calls=False) == whole
    assert tool_server.idle() and not tool_server.core.structured.matchers


# The tools of issue #51: get_weather's unit is any string, and a model may call the same tool again.
LOOSE_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
PROMPTS = ["What is the weather in Paris?", "What is 17 plus 25?", "Is it raining in Tokyo right now?",
           "How warm is it in Berlin and in Madrid?"]


def test_required_closes_its_list_over_prompts_tools_and_parallel(tool_server: RunningServer) -> None:
    # The default model repeats its call while the list may go on: the list is bounded, a repeat counts
    # once, and calls written before max_tokens cut the list come back (with finish_reason length).
    toolsets = ([LOOSE_WEATHER], [LOOSE_WEATHER, TOOLS[1], SEARCH])
    cases = [(p, ts, parallel, False, 100) for p in PROMPTS for ts in toolsets for parallel in (True, False)]
    cases += [(p, toolsets[0], True, True, 100) for p in PROMPTS]  # streamed: the same answers
    cut = [(PROMPTS[3], toolsets[0], True, stream, 40) for stream in (False, True)]  # inside the second call

    def ask(case: tuple[str, list[dict[str, Any]], bool, bool, int]) -> dict[str, Any]:
        prompt, tools, parallel, stream, max_tokens = case
        return _ask(tool_server, stream=stream, tools=tools, tool_choice="required", max_tokens=max_tokens,
                    parallel_tool_calls=parallel, messages=[{"role": "user", "content": prompt}])

    with ThreadPoolExecutor(len(cases + cut)) as pool:  # one batch in the engine: seconds, not minutes
        answers = list(pool.map(ask, cases + cut))
    for (prompt, tools, parallel, stream, max_tokens), got in zip(cases + cut, answers, strict=True):
        if stream:
            assert got == answers[(cases + cut).index((prompt, tools, parallel, False, max_tokens))], prompt
            continue
        calls = got["tool_calls"]
        assert 1 <= len(calls) <= (MAX_PARALLEL_CALLS if parallel else 1), got
        assert len(set(calls)) == len(calls) and got["content"] is None, got
        for name, args in calls:
            schema = next(t for t in tools if t["function"]["name"] == name)["function"]["parameters"]
            jsonschema.validate(json.loads(args), schema)
        assert got["finish_reason"] == "tool_calls", got  # lists cut short too: their calls come back
    assert answers[0]["tool_calls"] == [("get_weather", '{"city": "Paris", "unit": "miles"}')]  # the issue's
    berlin = answers[cases.index((PROMPTS[3], toolsets[0], True, False, 100))]
    assert [json.loads(a)["city"] for _, a in berlin["tool_calls"]] == ["Berlin", "Madrid"]
    assert answers[-1] == {"content": None, "reasoning": None, "tool_calls": berlin["tool_calls"][:1],
                           "finish_reason": "tool_calls"}
    assert tool_server.idle() and not tool_server.core.structured.matchers


def test_auto_reads_a_call_the_model_wrote_and_the_conversation_goes_on(tool_server: RunningServer) -> None:
    # The 135M model does not call tools of its own accord; a grammar makes it write a Hermes call (the
    # city is its own), and the auto parser reads it out of that text, streamed and whole.
    call = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", "unit": "C"\}\}'
            r"\n</tool_call>")
    kw = {"extra_body": {"structured_outputs": {"regex": call}}}
    whole = _ask(tool_server, **kw)
    assert whole["finish_reason"] == "tool_calls" and whole["content"] is None, whole
    (name, args), = whole["tool_calls"]
    assert name == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER)
    assert _ask(tool_server, stream=True, **kw) == whole
    # Free text stays text: no call, no tool_calls, finish_reason stop or length.
    plain = _ask(tool_server, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12)
    assert plain["tool_calls"] == [] and plain["content"] and plain["finish_reason"] in ("stop", "length")
    # The call and the tool's answer go back in; the model answers from it.
    messages = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "It is 21 C and sunny."}]
    follow = _ask(tool_server, messages=messages, tool_choice="none", max_tokens=30)
    assert follow["content"] and follow["tool_calls"] == [] and follow["finish_reason"] in ("stop", "length")
    assert tool_server.idle()


def test_reasoning_content_from_the_model(tool_server: RunningServer) -> None:
    # A grammar has the model write its reasoning in tags; the qwen3 parser splits it off.
    shaped = r"<think>\n[a-z ]{3,30}\n</think>\n\n[A-Z][a-z ]{2,30}\."
    kw = {"extra_body": {"structured_outputs": {"regex": shaped}}, "tool_choice": "none",
          "messages": [{"role": "user", "content": "Is the sky blue?"}]}
    whole = _ask(tool_server, **kw)
    assert whole["reasoning"] and whole["content"] and "<think>" not in whole["content"]
    assert _ask(tool_server, stream=True, **kw) == whole


@pytest.mark.parametrize("body, param, message", [
    ({"tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({}, "tool_choice", "--enable-auto-tool-choice"),  # auto is the default with tools
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in `tools`"),
    ({"tool_choice": "sometimes"}, "tool_choice", "not one of"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name", "letters, digits"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_tool_requests_refused_with_400(server: RunningServer, body: dict[str, Any], param: str,
                                        message: str) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
               "tools": TOOLS, **body}
    r = httpx.post(f"{server.base_url}/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert server.idle()


def test_tools_need_a_template_that_renders_them(make_server, default_loaded_model: Any) -> None:  # noqa: ANN001
    own = default_loaded_model.tokenizer.chat_template  # SmolLM2's own: no tools
    with make_server(chat_template=own) as srv:
        r = httpx.post(f"{srv.base_url}/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "tool_choice": "required"})
        assert r.status_code == 400 and "does not render `tools`" in r.json()["error"]["message"]


def test_shipped_template_renders_like_the_models_own_without_tools(default_loaded_model: Any) -> None:
    from server.chat_template import compile_template
    from specserve_configs import shipped
    from tests.helpers import CHATS

    own = compile_template(default_loaded_model.tokenizer.chat_template)
    ours = compile_template(shipped("templates", "smollm2-tools.jinja").read_text())
    chats = [[{"role": "user", "content": c}] for c in CHATS] + [[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]]
    for messages in chats:
        for gen in (True, False):
            context = {"messages": messages, "add_generation_prompt": gen, "tools": None}
            assert ours.render(context, 5, 10**6) == own.render(context, 5, 10**6)
    with_tools = ours.render({"messages": chats[0], "add_generation_prompt": True, "tools": TOOLS}, 5, 10**6)
    assert "<tools>" in with_tools and '"name": "get_weather"' in with_tools


def test_unknown_parsers_are_refused_at_start() -> None:
    from pydantic import ValidationError

    from server.settings import ServerSettings

    with pytest.raises(ValidationError, match="unknown tool call parser 'pythonic'"):
        ServerSettings(tool_call_parser="pythonic")
    with pytest.raises(ValidationError, match="needs --tool-call-parser"):
        ServerSettings(enable_auto_tool_choice=True)
    with pytest.raises(ValidationError, match="unknown reasoning parser"):
        ServerSettings(reasoning_parser="nope")
    assert {HermesParser.name, Llama3JsonParser.name, MistralParser.name} == set(PARSERS)

