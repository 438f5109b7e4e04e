"""Bridge between asyncio handlers and the engine thread: `EngineClient.submit` queues requests on
`EngineLoop`'s inbox and returns a `RequestStream`; the engine's per-output callback only hops onto the
handler's loop (`call_soon_threadsafe`). Closing an unfinished stream aborts its engine work, freeing
its KV blocks at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.detokenize import StopMatcher
from engine.loop import EngineDeadError, EngineLoop, ExitHook
from engine.models.loader import LoadedModel
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.spec.config import parse_speculative_config
from engine.stats import IterationStats
from engine.structured import CompiledGrammar
from server.errors import APIError
from server.metrics import EngineSnapshot, Metrics
from server.settings import ServerSettings
from server.step_trace import StepTrace

logger = logging.getLogger(__name__)

__all__ = ["EngineClient", "EngineDeadError", "RequestStream", "SubRequest", "create_engine_client"]


@dataclass(slots=True)
class SubRequest:
    """One engine request; an HTTP request maps to one per (prompt, choice)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stop_matcher: StopMatcher | None = None  # built off the event loop and the engine thread
    grammar: CompiledGrammar | None = None  # params.structured compiled, likewise
    checked: bool = False  # validated with the engine's check already (off the event loop)


class RequestStream:
    """Async iterator of (sub-request index, RequestOutput) over one HTTP request's engine requests.

    Must be closed (`close()`, or use as a context manager): unfinished engine requests are aborted.
    """

    def __init__(self, client: EngineClient, request_id: str, subs: list[SubRequest]) -> None:
        self._client = client
        self._queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        timeout = client.request_timeout
        self._deadline = None if timeout is None else self._loop.time() + timeout
        self.request_id = request_id
        self.engine_ids = [request_id if len(subs) == 1 else f"{request_id}-{i}" for i in range(len(subs))]
        self._pending: set[str] = set()
        try:
            for i, (rid, sub) in enumerate(zip(self.engine_ids, subs, strict=True)):
                client._loop.add_request(rid, sub.prompt_token_ids, sub.params, self._callback(i),
                                         sub.stop_matcher, checked=sub.checked, grammar=sub.grammar)
                self._pending.add(rid)
                client._unfinished.add(rid)
        except BaseException:
            self.close()
            raise

    def _callback(self, index: int) -> Callable[[RequestOutput], None]:
        put = self._queue.put_nowait
        loop = self._loop

        def on_output(out: RequestOutput) -> None:  # runs on the engine thread
            with contextlib.suppress(RuntimeError):  # event loop closed: nobody is listening any more
                loop.call_soon_threadsafe(put, (index, out))

        return on_output

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._pending:
            raise StopAsyncIteration
        if self._deadline is None:
            index, out = await self._queue.get()
        else:
            try:
                index, out = await asyncio.wait_for(self._queue.get(), self._deadline - self._loop.time())
            except TimeoutError:
                self.close()  # abort at the engine's next step: the KV blocks go back to the pool
                raise APIError(408, f"the request did not finish within --request-timeout "
                                    f"{self._client.request_timeout:g} s", code="request_timeout") from None
        if out.finished:
            self._finished(self.engine_ids[index])
        return index, out

    def _finished(self, rid: str) -> None:
        self._pending.discard(rid)
        self._client._unfinished.discard(rid)

    @property
    def finished(self) -> bool:
        return not self._pending

    def close(self) -> None:
        """Abort whatever has not finished (idempotent, never blocks)."""
        for rid in list(self._pending):
            self._client._loop.abort_request(rid)
            self._finished(rid)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EngineClient:
    """Owns the engine thread; all methods are called from the event loop's thread."""

    def __init__(self, core: EngineCore, served_model_names: list[str] | None = None,
                 request_timeout: float | None = None, step_trace: str | None = None,
                 exit_hook: ExitHook | None = None) -> None:
        self.core = core
        self.request_timeout = request_timeout
        self.served_model_names = served_model_names or [core.loaded.name]
        self.model_name = self.served_model_names[0]
        spec = core.spec
        self.metrics = Metrics(self.model_name, self.snapshot,
                               num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                               spec_method=spec.method if spec else "",
                               rejection_sample_method=spec.rejection_sample_method if spec else "standard")
        self.step_trace = StepTrace(step_trace) if step_trace else None
        self._loop = EngineLoop(core, stats_callback=self._on_stats, exit_hook=exit_hook)
        self._unfinished: set[str] = set()  # engine ids submitted and not yet seen finished

    def _on_stats(self, stats: IterationStats) -> None:  # engine thread, after every step
        self.metrics.on_iteration(stats)
        if self.step_trace is not None:
            self.step_trace.write(stats)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._loop.shutdown(timeout)
        if self.step_trace is not None:
            self.step_trace.close()

    @property
    def alive(self) -> bool:
        return self._loop.alive

    @property
    def error(self) -> BaseException | None:
        return self._loop.error

    @property
    def exit_hook(self) -> ExitHook | None:
        """Called with a non-zero status once the engine has stopped on a fatal error (see engine/loop.py)."""
        return self._loop.exit_hook

    @exit_hook.setter
    def exit_hook(self, hook: ExitHook | None) -> None:
        self._loop.exit_hook = hook

    # -- state ---------------------------------------------------------------------------------
    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def snapshot(self) -> EngineSnapshot:
        # len() of the scheduler's list/deque is atomic: safe to read while the engine thread runs.
        sched, pool = self.core.scheduler, self.core.kv.pool
        return EngineSnapshot(num_running=len(sched.running), num_waiting=len(sched.waiting),
                              kv_free_blocks=pool.num_free, kv_total_blocks=pool.num_blocks)

    def num_waiting(self) -> int:
        """Requests queued and not running, including those still in the engine's inbox."""
        return max(0, len(self._unfinished) - len(self.core.scheduler.running))

    def num_waiting_with(self, extra: int) -> int:
        """Engine requests that would wait for a running slot if `extra` more were submitted now. Free
        slots count only while the scheduler has admitted all it holds (else memory, not slots, is short)."""
        sched = self.core.scheduler
        free_slots = 0 if len(sched.waiting) else max(0, sched.max_num_seqs - len(sched.running))
        return max(0, self.num_waiting() + extra - free_slots)

    def abort_all(self) -> int:
        """Abort every unfinished request (shutdown); their handlers get an "abort" output each."""
        ids = list(self._unfinished)
        for rid in ids:
            self._loop.abort_request(rid)
        if ids:
            logger.info("aborted %d unfinished request(s)", len(ids))
        return len(ids)

    # -- requests ------------------------------------------------------------------------------
    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The engine's own validation (ValueError with its message). Returns the resolved max_tokens."""
        return self.core.check_request(prompt_token_ids, params)

    def submit(self, request_id: str, subs: list[SubRequest]) -> RequestStream:
        """Queue the sub-requests. Raises ValueError / EngineDeadError; nothing stays queued then."""
        return RequestStream(self, request_id, subs)


def create_engine_client(settings: ServerSettings, loaded: LoadedModel | None = None,
                         show_progress: bool = True) -> EngineClient:
    """Load the model (unless `loaded` is given: tests share one) and build the engine; the engine
    thread starts with the app's lifespan. Raises ValueError for bad settings."""
    kwargs = settings.engine_config_kwargs()
    # Parse here so a bad config fails with its own message, not wrapped in pydantic's.
    kwargs["speculative_config"] = parse_speculative_config(kwargs["speculative_config"])
    config = EngineConfig(**kwargs, show_progress=show_progress)
    core = EngineCore(config, loaded=loaded)
    return EngineClient(core, settings.served_model_name, settings.request_timeout, settings.step_trace)
