"""OpenAI (and vLLM-extension) request/response models. Requests forbid unknown fields and refuse fields
this server does not implement unless neutral; cross-field rules live in `check()` (raising `APIError`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling import StructuredOutputs
from server.errors import bad_request

MAX_CHOICES = 256  # prompts x n per request: bounds the work one HTTP request can queue
# OpenAI's own cap. Checked while the body is validated, on the event loop: a body of more messages
# would hold the loop (and every other route) for as long as validating them takes.
MAX_CHAT_MESSAGES = 2048


@dataclass(frozen=True, slots=True)
class StopLimits:
    """Per-request bounds on stop conditions (ServerSettings' max_stop_*: the defaults live there). The
    stop automaton's size grows with the strings' total length."""

    max_strings: int
    max_chars: int
    max_token_ids: int


def check_unicode(text: str, param: str) -> None:
    """JSON can carry lone surrogates; the tokenizer and the stop-string matcher take valid Unicode only."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{param} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at "
                          f"character {e.start}", param=param) from None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk
    include_obfuscation: bool | None = None  # OpenAI; nothing to obfuscate here


class ContentPart(BaseModel):
    # Not `extra="forbid"`: non-text parts are refused with a clear message in `text_of`.
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def template_fields(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it: role, content, and a tool turn's call id or an assistant
        turn's calls (arguments as objects, as Hugging Face templates expect them)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text_of(index)}
        if self.role == "tool":
            if not self.tool_call_id:
                raise bad_request(f"messages[{index}]: a tool message needs the tool_call_id it answers",
                                  param=f"messages.{index}.tool_call_id")
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            if self.role != "assistant":
                raise bad_request(f"messages[{index}]: only assistant messages carry tool_calls",
                                  param=f"messages.{index}.tool_calls")
            calls = []
            for j, call in enumerate(self.tool_calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"messages[{index}].tool_calls[{j}] needs function.name",
                                      param=f"messages.{index}.tool_calls.{j}")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    with contextlib.suppress(json.JSONDecodeError):  # else the template gets the text
                        args = json.loads(args)
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": args}})
            out["tool_calls"] = calls
        return out

    def text_of(self, index: int) -> str:
        if self.content is None:
            if self.role != "assistant":
                raise bad_request(f"messages[{index}].content is required for role {self.role!r}",
                                  param=f"messages.{index}.content")
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise bad_request(f"messages[{index}].content[{j}]: only text parts are supported "
                                  f"(got type {part.type!r})", param=f"messages.{index}.content.{j}")
            texts.append(part.text)
        return "".join(texts)

    def num_chars(self) -> int:
        """Length of the text `text_of` would return, without building it."""
        if isinstance(self.content, str):
            return len(self.content)
        return sum(len(part.text or "") for part in self.content or [])


# OpenAI fields without an implementation here: accepted only with these neutral values.
_NEUTRAL: dict[str, Any] = {
    "logit_bias": lambda v: not v,
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "suffix": lambda v: not v,
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "store": lambda v: not v,
}


class _SamplingRequest(_Request):
    """Fields shared by chat and completions (OpenAI + vLLM sampling extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation between tenants (the engine checks it)
    # accepted with neutral values only (see _NEUTRAL)
    logit_bias: dict[str, float] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check(self, max_n: int, stop_limits: StopLimits | None = None) -> None:
        for name, neutral in _NEUTRAL.items():
            if name in type(self).model_fields and not neutral(getattr(self, name)):
                raise bad_request(f"`{name}` is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise bad_request("`stream_options` is only allowed when `stream` is true",
                              param="stream_options")
        if not 1 <= self.n <= max_n:
            raise bad_request(f"n must be between 1 and {max_n}, got {self.n}", param="n")
        if isinstance(self.stop, list) and any(not s for s in self.stop) or self.stop == "":
            raise bad_request("stop strings must not be empty", param="stop")
        for s in self.stop_list():
            check_unicode(s, "stop")
        if stop_limits is not None:
            self._check_stop_limits(stop_limits)

    def _check_stop_limits(self, limits: StopLimits) -> None:
        stops = self.stop_list()
        if len(stops) > limits.max_strings:
            raise bad_request(f"`stop` has {len(stops)} strings; this server takes at most "
                              f"{limits.max_strings} (--max-stop-strings)", param="stop",
                              code="too_many_stop_strings")
        chars = sum(map(len, stops))
        if chars > limits.max_chars:
            raise bad_request(f"the `stop` strings have {chars} characters together; this server takes at "
                              f"most {limits.max_chars} (--max-stop-chars)", param="stop",
                              code="stop_too_long")
        ids = self.stop_token_ids or []
        if len(ids) > limits.max_token_ids:
            raise bad_request(f"`stop_token_ids` has {len(ids)} ids; this server takes at most "
                              f"{limits.max_token_ids} (--max-stop-token-ids)", param="stop_token_ids",
                              code="too_many_stop_token_ids")

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """What the output must match, and the field that asked (for error messages); raises a 400 for
        a malformed or ambiguous request. The grammar itself is compiled later, off the event loop."""
        found: list[tuple[str, StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type") if isinstance(rf, dict) else None
            if kind == "json_object":
                found.append(("response_format", StructuredOutputs(json_object=True)))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict):
                    raise bad_request("response_format.json_schema must be an object with a `schema`",
                                      param="response_format.json_schema")
                schema = spec.get("schema")
                if schema is None:
                    found.append(("response_format", StructuredOutputs(json_object=True)))
                else:
                    found.append(("response_format", StructuredOutputs(
                        json=_schema_text(schema, "response_format.json_schema.schema"))))
            elif kind != "text":
                raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, "
                                  f"json_schema)", param="response_format.type")
        compact = False
        body = self.structured_outputs
        if isinstance(body, dict) and set(body) == {"disable_any_whitespace"}:
            compact = body["disable_any_whitespace"] is True  # a modifier of the format sent elsewhere
        elif body is not None:
            found.append(("structured_outputs", _structured_from(body)))
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        for key, value in guided.items():
            if value is not None:
                found.append((f"guided_{key}", _structured_from({key: value}, f"guided_{key}")))
        if self.guided_decoding_backend not in (None, "auto", "llguidance", "guidance"):
            raise bad_request(f"guided_decoding_backend {self.guided_decoding_backend!r}: this server's "
                              f"grammar engine is llguidance", param="guided_decoding_backend")
        if len(found) > 1:
            raise bad_request(f"send one of response_format, structured_outputs and guided_*, not "
                              f"{', '.join(name for name, _ in found)}", param=found[1][0])
        if not found:
            return None, None
        param, spec = found[0]
        if compact:
            spec = dataclasses.replace(spec, disable_any_whitespace=True)
        try:
            spec.validate()
        except ValueError as e:
            raise bad_request(str(e).replace("structured_outputs", param), param=param) from None
        return spec, param

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema as JSON text: an object (or boolean), or a string holding one."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema object", param=param)
    return json.dumps(schema)


_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace")


def _structured_from(body: Any, param: str = "structured_outputs") -> StructuredOutputs:
    if not isinstance(body, dict):
        raise bad_request(f"{param} must be an object", param=param)
    unknown = sorted(set(body) - set(_STRUCTURED_KEYS))
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]} is not supported (this server takes "
                          f"{', '.join(_STRUCTURED_KEYS)})", param=f"structured_outputs.{unknown[0]}")
    compact = body.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise bad_request(f"{param}: `disable_any_whitespace` must be true or false", param=param)
    given = {k: v for k, v in body.items()
             if v is not None and v is not False and k != "disable_any_whitespace"}
    json_text = _schema_text(given["json"], param) if "json" in given else None
    for key in ("regex", "grammar"):
        if key in given and not isinstance(given[key], str):
            raise bad_request(f"{param}: `{key}` must be a string", param=param)
    choice = given.get("choice")
    if choice is not None and (not isinstance(choice, list) or any(not isinstance(c, str) for c in choice)):
        raise bad_request(f"{param}: `choice` must be a list of strings", param=param)
    return StructuredOutputs(json=json_text, json_object=given.get("json_object") is True,
                             regex=given.get("regex"), grammar=given.get("grammar"),
                             choice=tuple(choice) if choice is not None else None,
                             disable_any_whitespace=compact)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # vLLM extensions for the chat template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # accepted with neutral values only
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None

    def check(self, max_n: int, stop_limits: StopLimits | None = None) -> None:
        super().check(max_n, stop_limits)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("`top_logprobs` requires `logprobs` to be true", param="top_logprobs")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise bad_request("`max_tokens` and `max_completion_tokens` disagree; send one of them",
                              param="max_completion_tokens")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("`continue_final_message` needs `add_generation_prompt` false",
                              param="continue_final_message")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Engine `logprobs`: None (off) or the number of alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM extension

    def check(self, max_n: int, stop_limits: StopLimits | None = None) -> None:
        super().check(max_n, stop_limits)
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("`best_of` is not supported (it must equal n)", param="best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("`echo` with `logprobs` is not supported: prompt logprobs are not computed",
                              param="echo")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    @property
    def output_limit(self) -> int | None:
        # OpenAI's legacy default for completions is 16 tokens.
        return 16 if self.max_tokens is None else self.max_tokens


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_CHAT_MESSAGES)
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send exactly one of `prompt` and `messages`", param="prompt")
        if self.messages is not None and not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("`continue_final_message` needs `add_generation_prompt` false",
                              param="continue_final_message")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class SpecDecodeUsage(_Response):
    """Per-request speculative decoding summary (`--per-request-spec-decode-metrics summary`)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    spec_decode: SpecDecodeUsage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatMessageOut(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string / token id that ended it


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str
