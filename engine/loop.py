"""The engine thread: a loop around EngineCore with a thread-safe inbox; callbacks run on it and only hand
outputs over. A failed step fails every request and runs `exit_hook(FATAL_EXIT_CODE)`."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.core import EngineCore
from engine.detokenize import StopMatcher
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.stats import IterationStats
from engine.structured import CompiledGrammar

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
ExitHook = Callable[[int], None]
FATAL_EXIT_CODE = 70  # EX_SOFTWARE: an internal error, worth a restart
# What clients are told (the cause is logged).
_FATAL_MESSAGE = "the engine stopped after an internal error"
_ADD_FAILED = "the engine could not take the request in"


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    callback: OutputCallback
    stop_matcher: StopMatcher | None = None
    grammar: CompiledGrammar | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


class EngineDeadError(RuntimeError):
    pass


class EngineLoop:
    def __init__(self, core: EngineCore, stats_callback: Callable[[IterationStats], None] | None = None,
                 idle_poll_s: float = 0.05, exit_hook: ExitHook | None = None) -> None:
        """`exit_hook(code)` runs on the engine thread after a fatal error, every request failed (None: the
        engine stays stopped)."""
        self.core = core
        self.stats_callback = stats_callback
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stop = threading.Event()
        self._idle_poll_s = idle_poll_s
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self.error: BaseException | None = None
        self.exit_hook = exit_hook

    # -- API for other threads -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    callback: OutputCallback, stop_matcher: StopMatcher | None = None,
                    checked: bool = False, grammar: CompiledGrammar | None = None) -> None:
        """Raises ValueError for a request the engine cannot take. `stop_matcher`, `grammar`: as
        `EngineCore.add_request`; `checked`: the caller ran `check_request` (the engine checks again)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        if not checked:
            self.core.check_request(prompt_token_ids, params)
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, callback, stop_matcher, grammar))

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- engine thread -------------------------------------------------------------------------
    def _emit(self, out: RequestOutput) -> None:
        cb = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
        if cb is not None:
            self._call(cb, out)

    @staticmethod
    def _call(cb: OutputCallback, out: RequestOutput) -> None:
        try:
            cb(out)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the engine
            logger.exception("output callback for %s failed", out.request_id)

    def _handle(self, cmd: _Add | _Abort | None) -> None:
        if isinstance(cmd, _Add):
            try:
                self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.stop_matcher,
                                      cmd.grammar)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the engine's
                if isinstance(e, ValueError):  # the engine's own validation message
                    message = str(e)
                else:
                    logger.exception("adding request %s failed; failing it", cmd.request_id)
                    message = _ADD_FAILED
                self._call(cmd.callback, _error_output(cmd, "error", message))
                return
            self._callbacks[cmd.request_id] = cmd.callback
        elif isinstance(cmd, _Abort):
            out = self.core.abort_request(cmd.request_id)
            if out is not None:
                self._emit(out)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=self._idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.core.has_unfinished())
                if not self.core.has_unfinished():
                    self._report(self.core.take_finished_backlog())
                    continue
                outputs, stats = self.core.step()
                # Stats first: a client that got its last token sees the counters moved.
                self._report(stats)
                for out in outputs:
                    self._emit(out)
        except BaseException as e:  # noqa: BLE001 - record, then fail everyone waiting
            self.error = e
            logger.critical("the engine loop cannot go on; failing every request and stopping", exc_info=e)
        finally:
            self._fail_all("the engine stopped" if self.error is None else _FATAL_MESSAGE)
            self.core.close()
        if self.error is not None and self.exit_hook is not None:
            logger.critical("exiting with status %d for a supervisor to restart", FATAL_EXIT_CODE)
            self.exit_hook(FATAL_EXIT_CODE)

    def _report(self, stats: IterationStats | None) -> None:
        if stats is None or self.stats_callback is None:
            return
        try:
            self.stats_callback(stats)
        except Exception:  # noqa: BLE001 - metrics must not stop the engine
            logger.exception("stats callback failed")

    def _fail_all(self, message: str) -> None:
        """Every waiting caller gets a final output, even if the core's state is broken."""
        reason = "error" if self.error else "abort"
        for request_id, cb in list(self._callbacks.items()):
            try:
                out = self.core.abort_request(request_id)
            except Exception:  # noqa: BLE001 - a broken core must not leave this caller waiting
                logger.exception("aborting %s failed", request_id)
                out = None
            if out is None:
                out = RequestOutput(request_id, [], "", None, True, reason, None, 0, 0, 0)
            out.finish_reason, out.error = reason, message
            self._callbacks.pop(request_id, None)
            self._call(cb, out)
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._call(cmd.callback, _error_output(cmd, "abort", message))


def _error_output(cmd: _Add, reason: str, message: str) -> RequestOutput:
    """The one output of a request that never entered the engine."""
    return RequestOutput(cmd.request_id, [], "", None, True, reason, None, len(cmd.prompt_token_ids), 0, 0,
                         error=message)
