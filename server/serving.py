"""What the OpenAI endpoints share: `OpenAIServing` (sampling parameters, admission, engine submission,
logprobs formatting, collecting or streaming outputs), SSE and usage helpers. One HTTP request is one engine
request per (prompt, choice); streams end with `data: [DONE]`, and every exit path closes the
`RequestStream`, which aborts unfinished engine work."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.detokenize import StopMatcher, stop_matcher
from engine.models.loader import generation_defaults
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams, TokenLogprob
from engine.structured import GrammarError
from server.chat_prompt import ChatPrompts
from server.engine_client import EngineClient, EngineDeadError, RequestStream, SubRequest
from server.errors import APIError, bad_request, internal_error
from server.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    SpecDecodeUsage,
    StopLimits,
    TopLogprob,
    Usage,
)
from server.settings import ServerSettings
from server.tokens import TokenText, longest_token

logger = logging.getLogger(__name__)

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
T = TypeVar("T")


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else _MIN_LOGPROB


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """SSE response that always watches for the client going away (whatever the ASGI spec version)
    and runs `on_close` however it ends, even if the body never started streaming."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream_then_stop() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


@dataclass(slots=True)
class ChoiceState:
    """What one engine request produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    spec: tuple[int, int, int] = (0, 0, 0)  # drafts, draft tokens, accepted tokens

    def add(self, out: RequestOutput) -> None:
        if out.new_text:
            self.text.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.spec = (out.spec_num_drafts, out.spec_num_draft_tokens, out.spec_num_accepted_tokens)
        if out.finished:
            self.finish_reason, self.stop_reason, self.error = out.finish_reason, out.stop_reason, out.error


def _raise_if_failed(choice: ChoiceState, request_id: str) -> None:
    if choice.finish_reason == "error":  # `error` is the engine's short reason; the cause is in the log
        raise APIError(500, f"request {request_id} failed in the engine: {choice.error}", code="engine_error")
    if choice.finish_reason == "abort":
        raise APIError(503, f"the request was aborted: {choice.error or 'engine shutting down'}",
                       code="aborted")


def total_usage(choices: list[ChoiceState], n: int, with_spec: bool = False) -> Usage:
    # Prompt tokens count once per prompt (not per choice), as OpenAI / vLLM report them.
    firsts = choices[::n]
    prompt = sum(c.num_prompt_tokens for c in firsts)
    completion = sum(c.num_output_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in firsts)
    spec = None
    if with_spec:
        drafts, drafted, accepted = (sum(c.spec[i] for c in choices) for i in range(3))
        spec = SpecDecodeUsage(num_drafts=drafts, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                               acceptance_rate=accepted / drafted if drafted else None,
                               mean_acceptance_length=1 + accepted / drafts if drafts else None)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached), spec_decode=spec)


def _param_of(message: str, renames: dict[str, str] | None = None) -> str | None:
    """The request field an engine validation message is about (it starts with the field name);
    `renames` maps engine names to the endpoint's (chat calls `logprobs` `top_logprobs`)."""
    word = message.split(" ", 1)[0]
    if word in _SAMPLING_FIELDS:
        return (renames or {}).get(word, word)
    if message.startswith(("the prompt", "token id")):
        return "prompt"
    return None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _json(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)


class OpenAIServing:
    """State the endpoints share. Raises ValueError for settings that do not fit the model (the chat
    template or its defaults)."""

    def __init__(self, client: EngineClient, settings: ServerSettings) -> None:
        self.client = client
        self.settings = settings
        self.max_prompt_chars = (settings.max_prompt_chars
                                 or client.max_model_len * longest_token(client.tokenizer))
        self.tokens = TokenText(client.tokenizer, self.max_prompt_chars)
        self.log_requests = not settings.disable_log_requests
        self.spec_metrics = settings.per_request_spec_decode_metrics == "summary"
        self.stop_limits = StopLimits(settings.max_stop_strings, settings.max_stop_chars,
                                      settings.max_stop_token_ids)
        # Rendering and tokenizing run on these threads; requests beyond them wait without blocking the loop.
        self._preprocess = anyio.CapacityLimiter(settings.preprocess_threads)
        self.chat_prompts = ChatPrompts(settings, self.tokens, client.max_model_len,
                                        default_model=client.core.loaded.source == "default")
        self.sampling_defaults = self._sampling_defaults(client.core.loaded.path)

    def _sampling_defaults(self, model_path: str) -> dict[str, Any]:
        source, override = self.settings.generation_config, self.settings.override_generation_config
        defaults = generation_defaults(source, model_path, override)
        if defaults:
            origin = f"--generation-config {source}" + (" (the model folder's generation_config.json)"
                                                         if source == "auto" else "")
            if override:
                origin += " and --override-generation-config"
            logger.info("sampling defaults for the fields a request leaves out: %s (from %s; OpenAI's "
                        "defaults stay with --generation-config vllm)",
                        ", ".join(f"{k}={v}" for k, v in defaults.items()), origin)
        return defaults

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-heavy preprocessing on the bounded thread pool, keeping the event loop free."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._preprocess)

    # -- request in: parameters, checks, admission ----------------------------------------------
    def resolve_model(self, name: str | None) -> str:
        if name is None or name in self.client.served_model_names:
            return name or self.client.model_name
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def sampling_params(self, req: ChatCompletionRequest | CompletionRequest,
                        logprobs: int | None) -> tuple[SamplingParams, bool]:
        """The request's SamplingParams, and whether max_tokens is the model's default (the engine fits it
        to the room each prompt leaves; a max_tokens the client sent is refused past that room instead).
        Each field: the request's value, else the model's default (--generation-config), else OpenAI's."""
        defaults = self.sampling_defaults
        sent = (req.max_tokens if isinstance(req, CompletionRequest) else req.output_limit) is not None
        from_model = not sent and "max_tokens" in defaults
        p = SamplingParams(max_tokens=defaults["max_tokens"] if from_model else req.output_limit,
                           stop=req.stop_list(),
                           stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                           min_tokens=req.min_tokens, logprobs=logprobs,
                           include_stop_str_in_output=req.include_stop_str_in_output,
                           skip_special_tokens=req.skip_special_tokens, cache_salt=req.cache_salt)
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(req, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                setattr(p, name, value)
        return p, from_model

    @staticmethod
    def check_choices(num_prompts: int, n: int) -> None:
        if num_prompts * n > MAX_CHOICES:
            raise bad_request(f"too many choices: {num_prompts} prompts x n={n} > {MAX_CHOICES}", param="n")

    @staticmethod
    def structured(req: ChatCompletionRequest | CompletionRequest, params: SamplingParams) -> str | None:
        """Set `params.structured` from the request (blocking: a schema is serialised; call through
        `offload`). Returns the field that asked for it."""
        params.structured, param = req.structured()
        return param

    def prepare(self, prompts: list[list[int]], params: SamplingParams, n: int,
                renames: dict[str, str] | None = None, fit_max_tokens: bool = False,
                structured_param: str | None = None) -> list[SubRequest]:
        """Validate every prompt with the engine and expand to one sub-request per choice, compiling the
        request's grammar (blocking: call through `offload`).
        `fit_max_tokens`: max_tokens is a server default, shortened to each prompt's room, never refused."""
        max_len = self.client.max_model_len
        for ids in prompts:
            if (not fit_max_tokens and isinstance(params.max_tokens, int)
                    and len(ids) + params.max_tokens > max_len):
                raise bad_request(
                    f"This model's maximum context length is {max_len} tokens. However, you requested "
                    f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the messages, "
                    f"{params.max_tokens} in the completion). Please reduce the length of the messages "
                    f"or completion.", param=(renames or {}).get("max_tokens", "max_tokens"),
                    code="context_length_exceeded")
            try:
                self.client.check(ids, params)
            except ValueError as e:
                raise bad_request(str(e), param=_param_of(str(e), renames)) from e
        grammar = None
        if params.structured is not None:
            param = structured_param or "structured_outputs"
            try:
                grammar = self.client.core.structured.compiler.compile(params.structured)
            except GrammarError as e:
                raise bad_request(f"{param}: {e}", param=param, code="invalid_grammar") from None
        subs = []
        for ids in prompts:
            for j in range(n):
                p = params
                if n > 1 and params.seed is not None:
                    # distinct but reproducible choices, as vLLM derives child seeds (kept in 64 bits)
                    seed = params.seed + j
                    p = dataclasses.replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)
                subs.append(SubRequest(ids, p, checked=True, grammar=grammar))
        return subs

    async def submit(self, request_id: str, subs: list[SubRequest]) -> RequestStream:
        limit = self.settings.max_waiting_requests
        if limit is not None:
            self._admit(len(subs), limit)  # before any work: an overloaded server refuses at once
        await self._build_stop_matchers(request_id, subs)
        # No await from here on: the admission check and the queueing happen as one step.
        if limit is not None:
            self._admit(len(subs), limit)
        try:
            stream = self.client.submit(request_id, subs)
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not running: {e}", code="engine_dead") from e
        except ValueError as e:
            raise bad_request(str(e), param=_param_of(str(e))) from e
        if self.log_requests:
            p = subs[0].params
            logger.info("request %s: %d engine request(s), prompt tokens %s, max_tokens=%s, "
                        "temperature=%s, seed=%s", request_id, len(subs),
                        sorted({len(s.prompt_token_ids) for s in subs}), p.max_tokens, p.temperature, p.seed)
        return stream

    def _admit(self, num: int, limit: int) -> None:
        """--max-waiting-requests counts engine requests (prompts x n), this request's included."""
        slots = self.settings.max_num_seqs
        if num > limit + slots:
            raise bad_request(f"this request makes {num} engine requests (prompts x n), more than this "
                              f"server ever queues (--max-waiting-requests {limit} + --max-num-seqs {slots})",
                              param="n", code="too_many_choices")
        waiting = self.client.num_waiting_with(num)
        if waiting > limit:
            raise APIError(503, f"the server is overloaded: {waiting} engine requests would wait, over "
                                f"--max-waiting-requests {limit}; retry later",
                           code="server_overloaded", headers={"Retry-After": "1"})

    async def _build_stop_matchers(self, request_id: str, subs: list[SubRequest]) -> None:
        """Compile each distinct stop list once, in a worker thread (its cost grows with the strings'
        length, bounded by --max-stop-chars) on the preprocessing threads: neither the event loop nor the
        engine thread pays for it."""
        keys = {tuple(s.params.stop) for s in subs if s.params.stop}
        if not keys:
            return
        try:
            built: dict[tuple[str, ...], StopMatcher | None] = await self.offload(
                lambda: {key: stop_matcher(key) for key in keys})
        except MemoryError as e:
            logger.error("request %s: out of memory compiling its stop strings", request_id)
            raise bad_request("not enough memory to compile the stop strings: send fewer or shorter ones",
                              param="stop", code="stop_too_long") from e
        except Exception as e:
            logger.exception("request %s: compiling its stop strings failed", request_id)
            raise APIError(500, f"request {request_id} failed: its stop strings could not be compiled",
                           code="internal_error") from e
        for sub in subs:
            sub.stop_matcher = built.get(tuple(sub.params.stop))

    # -- outputs back: whole or streamed ---------------------------------------------------------
    def log_done(self, request_id: str, choices: list[ChoiceState], t0: float, outcome: str = "") -> None:
        if self.log_requests:
            reasons = sorted({str(c.finish_reason) for c in choices})
            logger.info("request %s finished%s: %s, %d output tokens, %.2fs", request_id, outcome,
                        "/".join(reasons), sum(c.num_output_tokens for c in choices), time.monotonic() - t0)

    async def unless_disconnected(self, raw: Request, stream: RequestStream,
                                  work: Awaitable[Response]) -> Response:
        """Run a non-streaming request; if the client goes away first, cancel it (aborting its work)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)  # nobody is listening; the status only shows in logs
        finally:
            watcher.cancel()
            task.cancel()  # no-op once done; on our own cancellation (shutdown) it stops the work
            stream.close()  # even if the task never started, the engine requests are aborted

    async def collect(self, stream: RequestStream, num: int, t0: float) -> list[ChoiceState]:
        choices = [ChoiceState() for _ in range(num)]
        try:
            async for index, out in stream:
                choices[index].add(out)
            for c in choices:
                _raise_if_failed(c, stream.request_id)
        except APIError as e:
            self.log_done(stream.request_id, choices, t0, f" with error {e.status}")
            raise
        finally:
            stream.close()
        return choices

    async def stream_events(self, req: ChatCompletionRequest | CompletionRequest, stream: RequestStream,
                            num: int, chunk: Callable[..., str], opening: list[str],
                            delta: Callable[[int, RequestOutput, ChoiceState], Any]) -> AsyncIterator[str]:
        """The SSE stream of chat and completions: `delta` turns an engine output into the endpoint's
        chunk choice (None: nothing to send yet)."""
        t0 = time.monotonic()
        choices = [ChoiceState() for _ in range(num)]
        try:
            for event in opening:
                yield event
            async for index, out in stream:
                c = choices[index]
                c.add(out)
                if out.finished:
                    _raise_if_failed(c, stream.request_id)
                choice = delta(index, out, c)
                if choice is None:
                    continue
                usage = total_usage(choices, req.n, self.spec_metrics) if req.continuous_usage else None
                yield chunk([choice], usage)
            if req.include_usage:
                yield chunk([], total_usage(choices, req.n, self.spec_metrics))
            self.log_done(stream.request_id, choices, t0)
        except APIError as e:
            yield sse(_json(e.body()))
            self.log_done(stream.request_id, choices, t0, f" with error {e.status}")
        except Exception as e:  # noqa: BLE001 - fail this stream only, in the OpenAI shape
            yield sse(_json(internal_error(stream.request_id, e).body()))
        finally:
            stream.close()
        yield SSE_DONE

    # -- logprobs ------------------------------------------------------------------------------
    def chat_logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs:
        t = self.tokens
        return ChatLogprobs(content=[
            ChatTokenLogprob(
                token=t.text(lp.token_id), logprob=_finite(lp.logprob), bytes=t.bytes(lp.token_id),
                top_logprobs=[TopLogprob(token=t.text(i), logprob=_finite(v), bytes=t.bytes(i))
                              for i, v in lp.top])
            for lp in lps])

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> tuple[CompletionLogprobs, int]:
        """Legacy completions shape; `offset` is where this text starts in the choice's text."""
        t = self.tokens
        out = CompletionLogprobs()
        for lp in lps:
            text = t.text(lp.token_id)
            top = {t.text(i): _finite(v) for i, v in lp.top}
            top.setdefault(text, _finite(lp.logprob))  # OpenAI: the sampled token is always listed
            out.tokens.append(text)
            out.token_logprobs.append(_finite(lp.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset
