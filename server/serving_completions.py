"""`/v1/completions`: text or token-id prompts (several per request), echo, legacy logprobs; answered
whole or as Server-Sent Events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from server.engine_client import RequestStream, SubRequest
from server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage, now
from server.serving import ChoiceState, EventStreamResponse, OpenAIServing, sse, total_usage


class CompletionServing:
    """The endpoint over the shared `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        s = self.serving
        request_id = raw.state.request_id = f"cmpl-{uuid.uuid4().hex}"
        model = s.resolve_model(req.model)
        req.check(s.settings.max_n, s.stop_limits)
        prompts = req.prompts()
        s.check_choices(len(prompts), req.n)
        for p in prompts:
            if isinstance(p, str):
                s.tokens.check_length(p, "prompt")
        params, fit = s.sampling_params(req, req.logprobs)

        def preprocess() -> tuple[list[SubRequest], list[str]]:
            structured_param = s.structured(req, params)
            ids = [s.tokens.encode(p, req.add_special_tokens) if isinstance(p, str) else p for p in prompts]
            # token ids are range-checked here, before any decoding
            subs = s.prepare(ids, params, req.n, fit_max_tokens=fit, structured_param=structured_param)
            texts: list[str] = []
            if req.echo:
                decoded = iter(s.tokens.decode_many([p for p in prompts if not isinstance(p, str)], False))
                texts = [p if isinstance(p, str) else next(decoded) for p in prompts]
            return subs, texts

        subs, texts = await s.offload(preprocess)
        stream = await s.submit(request_id, subs)
        echoes = [texts[i // req.n] if req.echo else "" for i in range(len(subs))]
        if req.stream:
            return EventStreamResponse(self._events(req, stream, model, echoes), stream.close)
        return await s.unless_disconnected(raw, stream, self._full(req, stream, model, echoes))

    async def _full(self, req: CompletionRequest, stream: RequestStream, model: str,
                    echoes: list[str]) -> Response:
        s = self.serving
        t0 = time.monotonic()
        choices = await s.collect(stream, len(echoes), t0)
        out = []
        for i, (c, echo) in enumerate(zip(choices, echoes, strict=True)):
            logprobs = None
            if req.logprobs is not None:
                logprobs = s.completion_logprobs(c.logprobs, len(echo))[0]
            out.append(CompletionChoice(index=i, text=echo + "".join(c.text), logprobs=logprobs,
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        resp = CompletionResponse(id=stream.request_id, model=model, choices=out,
                                  usage=total_usage(choices, req.n, s.spec_metrics))
        s.log_done(stream.request_id, choices, t0)
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _events(self, req: CompletionRequest, stream: RequestStream, model: str,
                      echoes: list[str]) -> AsyncIterator[str]:
        s = self.serving
        created = now()
        offsets = [len(e) for e in echoes]

        def chunk(choice_list: list[CompletionChoice], usage: Usage | None = None) -> str:
            return sse(CompletionResponse(id=stream.request_id, created=created, model=model,
                                          choices=choice_list, usage=usage).model_dump_json())

        def delta(index: int, out: RequestOutput, c: ChoiceState) -> CompletionChoice | None:
            logprobs = None
            if req.logprobs is not None and out.new_logprobs:
                logprobs, offsets[index] = s.completion_logprobs(out.new_logprobs, offsets[index])
            if not (out.new_text or logprobs or out.finished):
                return None
            return CompletionChoice(index=index, text=out.new_text, logprobs=logprobs,
                                    finish_reason=c.finish_reason if out.finished else None,
                                    stop_reason=c.stop_reason if out.finished else None)

        opening = [chunk([CompletionChoice(index=i, text=echo)]) for i, echo in enumerate(echoes) if echo]
        async for event in s.stream_events(req, stream, len(echoes), chunk, opening, delta):
            yield event
