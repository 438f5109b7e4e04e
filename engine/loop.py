"""The engine thread: a synchronous loop around EngineCore with a thread-safe inbox.

Callers (the HTTP server) submit with `add_request(..., callback)`; the callback runs on the engine
thread with each RequestOutput and must only hand it over (e.g. `loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.core import EngineCore
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.stats import IterationStats

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    callback: OutputCallback


@dataclass(slots=True)
class _Abort:
    request_id: str


class EngineDeadError(RuntimeError):
    pass


class EngineLoop:
    def __init__(self, core: EngineCore, stats_callback: Callable[[IterationStats], None] | None = None,
                 idle_poll_s: float = 0.05) -> None:
        self.core = core
        self.stats_callback = stats_callback
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stop = threading.Event()
        self._idle_poll_s = idle_poll_s
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self.error: BaseException | None = None

    # -- API for other threads -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    callback: OutputCallback) -> None:
        """Raises ValueError for a request the engine cannot take (before it is queued)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        self.core.check_request(prompt_token_ids, params)
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, callback))

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
        if cb is None:
            return
        try:
            cb(out)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the engine
            logger.exception("output callback for %s failed", out.request_id)

    def _handle(self, cmd: _Add | _Abort | None) -> None:
        if isinstance(cmd, _Add):
            try:
                self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params)
            except ValueError as e:
                cmd.callback(RequestOutput(cmd.request_id, [], "", None, True, "error", None,
                                           len(cmd.prompt_token_ids), 0, 0, error=str(e)))
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
                # Stats first: a client that got its last token then sees the counters already moved.
                self._report(stats)
                for out in outputs:
                    self._emit(out)
        except BaseException as e:  # noqa: BLE001 - record, then fail everyone waiting
            self.error = e
            logger.exception("engine thread died")
        finally:
            self._fail_all("the engine stopped" if self.error is None else f"engine error: {self.error}")

    def _report(self, stats: IterationStats | None) -> None:
        if stats is None or self.stats_callback is None:
            return
        try:
            self.stats_callback(stats)
        except Exception:  # noqa: BLE001 - metrics must not stop the engine
            logger.exception("stats callback failed")

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._callbacks):
            out = self.core.abort_request(request_id)
            if out is not None:
                out.finish_reason, out.error = "error" if self.error else "abort", message
                self._emit(out)
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.callback(RequestOutput(cmd.request_id, [], "", None, True, "abort", None,
                                           len(cmd.prompt_token_ids), 0, 0, error=message))
