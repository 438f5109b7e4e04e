"""Tool calling: the request's tools checked, the grammar that forces a call (`tool_choice` "required" or a
named function, as vLLM builds it: the calls as JSON the grammar validates against each function's
parameters), and parsers that read calls out of free model output (`--tool-call-parser`) in the formats
models are trained on. A parser that cannot read a call leaves the text as plain content: never a 500."""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from server.errors import bad_request

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> str | None:
    """Validate `tools` and `tool_choice` (400s naming the field). Returns the effective choice: None (no
    tools, or "none"), "auto", "required", or the name of the function the request forces."""
    names: list[str] = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                              param=f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -",
                              param=f"tools.{i}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              param=f"tools.{i}.function.parameters")
        names.append(name)
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    if tool_choice is None:
        return "auto" if names else None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice {tool_choice!r} is not one of none, auto, required or a named "
                              f"function", param="tool_choice")
        if tool_choice != "none" and not names:
            raise bad_request(f"tool_choice {tool_choice!r} needs `tools`", param="tool_choice")
        return None if tool_choice == "none" else tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request('tool_choice must be none, auto, required or {"type": "function", '
                          '"function": {"name": ...}}', param="tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not in `tools`", param="tool_choice")
    return name


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


# Calls a parallel "required" list may hold: a forced list cannot end at end-of-sequence, and a model that
# repeats its call must still reach the closing bracket.
MAX_PARALLEL_CALLS = 4
# Forced calls are written without layout whitespace: fewer tokens, and no room for a whitespace loop.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def forced_schema(tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    """The JSON schema the output must match when a call is forced: a named function's arguments, or for
    "required" a list of {"name", "parameters"} objects, each against its function (one with `parallel`
    false, up to MAX_PARALLEL_CALLS otherwise). Either is written as compact JSON."""
    if choice != "required":
        schema = dict(next(_parameters(t) for t in tools if t["function"]["name"] == choice))
        return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **_COMPACT}}
    variants = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": _parameters(t)},
                 "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
            "items": {"anyOf": variants}, "x-guidance": {**_COMPACT}}


def _past_ws(text: str, at: int) -> int:
    """The first index from `at` on that is not JSON whitespace."""
    m = _WS.match(text, at)
    assert m is not None  # `*`: it matches everywhere
    return m.end()


def _json_items(text: str) -> list[Any]:
    """The complete items of a JSON list, also of one cut short (raises ValueError where no list begins)."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    at = _past_ws(text, 0)
    if not text.startswith("[", at):
        raise ValueError("not a JSON list")
    at = _past_ws(text, at + 1)
    while not text.startswith("]", at):
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(item)
        at = _past_ws(text, at)
        if text.startswith(",", at):
            at = _past_ws(text, at + 1)
        elif not text.startswith("]", at):
            return items
    return items


def forced_calls(text: str, choice: str) -> list[ToolCall]:
    """The calls in the output a forced choice's grammar produced. A "required" list cut short
    (max_tokens) gives the calls it completed; a repeated call counts once, as a model looping on its call
    repeats it. Raises ValueError when no call is complete."""
    if choice != "required":
        json.loads(text)
        return [ToolCall(choice, text)]
    items = _json_items(text)
    calls: list[ToolCall] = []
    seen: set[tuple[str, str]] = set()
    for item in items:
        args = json.dumps(item["parameters"], ensure_ascii=False)
        key = (item["name"], json.dumps(item["parameters"], sort_keys=True))
        if key not in seen:
            seen.add(key)
            calls.append(ToolCall(item["name"], args))
    if not calls:
        raise ValueError("no complete call")
    return calls


def _call_from(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser(ABC):
    """Reads tool calls out of a model's free output."""

    name: str
    # Where a call starts: streamed content is held back from here (and while the text could still be
    # the beginning of it).
    start: str

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content outside the calls or None, calls); no calls and the whole text when none parse."""

    def content_end(self, text: str) -> int:
        """How much of `text` is content for certain: up to the start marker, or up to a tail that could
        begin it."""
        at = text.find(self.start)
        return at if at >= 0 else _safe_end(text, self.start)


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3, the shipped
    SmolLM2 template)."""

    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call_from(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # one unreadable call: the whole answer stays text
            calls.append(call)
        content = text[: text.find(self.start)].strip()
        return content or None, calls


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, several separated by `;`, optionally
    after `<|python_tag|>`."""

    name = "llama3_json"
    start = "{"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _call_from(obj)
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return None, calls

    def content_end(self, text: str) -> int:
        # A Llama 3 answer is either a call (JSON from its first character) or text.
        stripped = text.lstrip().removeprefix("<|python_tag|>").lstrip()
        if not stripped or stripped.startswith("{") or "<|python_tag|>".startswith(text.lstrip()):
            return 0
        return len(text)


class MistralParser(ToolParser):
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral)."""

    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        try:
            items, _ = json.JSONDecoder().raw_decode(text[at + len(self.start):].lstrip())
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call_from(i) for i in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:at].strip() or None, calls  # type: ignore[return-value]


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


class Qwen3ReasoningParser:
    """Thinking in `<think>...</think>` (Qwen3, DeepSeek-R1): an answer that opens with `<think>` keeps
    what lies inside in `reasoning_content`; the text after `</think>` is the content."""

    name = "qwen3"
    open, close = "<think>", "</think>"

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole answer."""
        body = text.lstrip()
        if not body.startswith(self.open):
            return None, text
        body = body[len(self.open):]
        end = body.find(self.close)
        if end < 0:
            return body.strip("\n"), ""
        return body[:end].strip("\n"), body[end + len(self.close):].lstrip("\n")


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": Qwen3ReasoningParser}


def _safe_end(text: str, marker: str) -> int:
    """End of the part of `text` that cannot be the start of `marker` (a tail that could be is held)."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] | None = None
    finish_reason: str | None = None


class ChatOutput:
    """One choice's generated text as OpenAI's message parts: reasoning, content, tool calls. Text goes in
    as it streams (`feed`), `finish` ends it. Each delta extends what is certain so far of the parts a
    whole answer gives (`whole`), so a streamed answer reassembles to the non-streamed one."""

    def __init__(self, choice: str | None, parser: ToolParser | None,
                 reasoning: Qwen3ReasoningParser | None) -> None:
        self.choice = choice  # None, "auto", "required" or a function name
        self.parser = parser if choice == "auto" else None
        self.reasoning = reasoning
        self.text = ""
        self._reasoning_sent = ""
        self._content_sent = ""

    def _parts(self, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, raw content) certain so far (all of them when `final`); None: not started."""
        r = self.reasoning
        if r is None:
            return None, self.text
        lead = self.text.lstrip()
        if not lead.startswith(r.open):
            if not final and r.open.startswith(lead):
                return None, None  # it may still open with the tag
            return None, self.text
        body = lead[len(r.open):]
        close = body.find(r.close)
        if close < 0:
            return (body if final else body[:_safe_end(body, r.close)]).strip("\n"), ("" if final else None)
        return body[:close].strip("\n"), body[close + len(r.close):].lstrip("\n")

    def _content(self, raw: str, final: bool) -> tuple[str, list[ToolCall]]:
        """The content (certain so far, or all of it) and, when final, the calls."""
        if self.choice is None:
            return raw, []
        if self.parser is not None:
            if final:
                content, calls = self.parser.parse(raw)
                return (content or "", calls) if calls else (raw, [])
            return raw[: self.parser.content_end(raw)].rstrip(), []
        if not final:
            return "", []  # a forced call: nothing is content unless it fails to parse
        try:
            calls = forced_calls(raw, self.choice)
        except (ValueError, KeyError, TypeError):  # cut short before a call was complete: the text as it came
            return raw, []
        return "", calls

    def _delta(self, final: bool) -> tuple[Delta, list[ToolCall]]:
        reasoning, raw = self._parts(final)
        out = Delta()
        calls: list[ToolCall] = []
        if reasoning is not None and len(reasoning) > len(self._reasoning_sent):
            out.reasoning = reasoning[len(self._reasoning_sent):]
            self._reasoning_sent = reasoning
        if raw is not None:
            content, calls = self._content(raw, final)
            if len(content) > len(self._content_sent):
                out.content = content[len(self._content_sent):]
                self._content_sent = content
        return out, calls

    def feed(self, new: str) -> Delta:
        self.text += new
        return self._delta(final=False)[0]

    def finish(self, finish_reason: str | None) -> Delta:
        out, calls = self._delta(final=True)
        out.calls = calls or None
        # Returned calls finish as "tool_calls" (as vLLM does), those of a list cut short included: a client
        # dispatches on it, and each call it gets is whole.
        out.finish_reason = "tool_calls" if calls else finish_reason
        return out

    def whole(self, text: str, finish_reason: str | None) -> tuple[str | None, str | None, list[ToolCall],
                                                                   str | None]:
        """(reasoning, content, calls, finish_reason) of a whole answer."""
        first = self.feed(text)
        last = self.finish(finish_reason)
        reasoning, _ = self._parts(final=True)
        content = first.content + last.content
        calls = last.calls or []
        return reasoning, (content if content or not calls else None), calls, last.finish_reason
