"""`/v1/chat/completions`: messages rendered with the chat template, tools and reasoning parsed out of the
model's text, answered whole or as Server-Sent Events."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from engine.sampling import StructuredOutputs
from server.engine_client import RequestStream, SubRequest
from server.errors import bad_request
from server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    DeltaMessage,
    Usage,
    now,
)
from server.serving import ChoiceState, EventStreamResponse, OpenAIServing, sse, total_usage
from server.tools import PARSERS, REASONING_PARSERS, ChatOutput, Delta, check_tools, forced_schema

_CHAT_NAMES = {"logprobs": "top_logprobs"}  # engine field -> chat request field


class ChatServing:
    """The endpoint over the shared `OpenAIServing`, with the server's tool and reasoning parsers."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        settings = serving.settings
        self.tool_parser = PARSERS[settings.tool_call_parser]() if settings.tool_call_parser else None
        self.reasoning_parser = (REASONING_PARSERS[settings.reasoning_parser]()
                                 if settings.reasoning_parser else None)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        s, prompts = self.serving, self.serving.chat_prompts
        request_id = raw.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        model = s.resolve_model(req.model)
        req.check(s.settings.max_n, s.stop_limits)
        s.check_choices(1, req.n)
        prompts.check_messages(req.messages)
        source, kwargs = prompts.template_request(req.chat_template, req.chat_template_kwargs)
        params, fit = s.sampling_params(req, req.num_logprobs)
        renames = _CHAT_NAMES
        if req.max_completion_tokens is not None:
            renames = {**_CHAT_NAMES, "max_tokens": "max_completion_tokens"}
        choice = check_tools(req.tools, req.tool_choice)
        if choice == "auto" and not s.settings.enable_auto_tool_choice:
            raise bad_request('tool_choice "auto" (the default with `tools`) needs the server started with '
                              '--enable-auto-tool-choice and --tool-call-parser; or send "required", a named '
                              'function, or "none"', param="tool_choice")

        def preprocess() -> list[SubRequest]:
            structured_param = s.structured(req, params)
            if choice not in (None, "auto"):
                if params.structured is not None:
                    raise bad_request(f"a forced tool call (tool_choice {req.tool_choice!r}) cannot be "
                                      f"combined with {structured_param}", param="tool_choice")
                schema = forced_schema(req.tools or [], choice, req.parallel_tool_calls is not False)
                params.structured = StructuredOutputs(json=json.dumps(schema))
                structured_param = "tools"
            prompt = prompts.render(req.messages, source, kwargs, req.add_generation_prompt,
                                    req.continue_final_message, req.tools if choice else None)
            return s.prepare([prompt], params, req.n, renames, fit, structured_param)

        subs = await s.offload(preprocess)
        stream = await s.submit(request_id, subs)
        shape = functools.partial(ChatOutput, choice, self.tool_parser, self.reasoning_parser)
        if req.stream:
            return EventStreamResponse(self._events(req, stream, model, len(subs), shape), stream.close)
        return await s.unless_disconnected(raw, stream, self._full(req, stream, model, len(subs), shape))

    async def _full(self, req: ChatCompletionRequest, stream: RequestStream, model: str, num: int,
                    shape: Callable[[], ChatOutput]) -> Response:
        s = self.serving
        t0 = time.monotonic()
        choices = await s.collect(stream, num, t0)
        out = []
        for i, c in enumerate(choices):
            reasoning, content, calls, finish = shape().whole("".join(c.text), c.finish_reason)
            out.append(ChatChoice(
                index=i, message=ChatMessageOut(content=content, reasoning_content=reasoning,
                                                tool_calls=[call.as_openai() for call in calls]),
                logprobs=s.chat_logprobs(c.logprobs) if req.logprobs else None, finish_reason=finish,
                stop_reason=c.stop_reason))
        resp = ChatCompletionResponse(id=stream.request_id, model=model,
                                      usage=total_usage(choices, req.n, s.spec_metrics), choices=out)
        s.log_done(stream.request_id, choices, t0)
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _events(self, req: ChatCompletionRequest, stream: RequestStream, model: str, num: int,
                      shape: Callable[[], ChatOutput]) -> AsyncIterator[str]:
        s = self.serving
        created = now()
        shapers = [shape() for _ in range(num)]

        def chunk(choice_list: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return sse(ChatCompletionChunk(id=stream.request_id, created=created, model=model,
                                           choices=choice_list, usage=usage).model_dump_json())

        def delta(index: int, out: RequestOutput, c: ChoiceState) -> ChatChunkChoice | None:
            logprobs = s.chat_logprobs(out.new_logprobs) if req.logprobs and out.new_logprobs else None
            part = shapers[index].feed(out.new_text)
            if out.finished:
                end = shapers[index].finish(c.finish_reason)
                part = Delta(part.reasoning + end.reasoning, part.content + end.content, end.calls,
                             end.finish_reason)
            if not (part.content or part.reasoning or logprobs or out.finished):
                return None  # text held back (a stop string, a tool call, a tag): nothing to say yet
            calls = [{"index": j, **call.as_openai()} for j, call in enumerate(part.calls or [])] or None
            return ChatChunkChoice(
                index=index, delta=DeltaMessage(content=part.content or None,
                                                reasoning_content=part.reasoning or None, tool_calls=calls),
                logprobs=logprobs, finish_reason=part.finish_reason if out.finished else None,
                stop_reason=c.stop_reason if out.finished else None)

        opening = [chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                   for i in range(num)]
        async for event in s.stream_events(req, stream, num, chunk, opening, delta):
            yield event
