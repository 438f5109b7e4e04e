"""`--step-trace FILE`: one JSON line per engine step, for telling what a server computed from how fast it
computed it (docs/monitoring.md, "Step traces"). Written on the engine thread: ~200 bytes, one buffered
write per step."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from typing import IO, Any

from engine.stats import IterationStats

logger = logging.getLogger(__name__)


def step_record(stats: IterationStats) -> dict[str, Any]:
    """The trace line of one step: `tokens` is what the model computed (prefill chunks, one row per
    decoding request, drafts), `generated` what it emitted."""
    spec = stats.spec
    rec: dict[str, Any] = {
        "t": round(stats.timestamp, 4),
        "step_s": round(stats.step_seconds, 5),
        "requests": stats.num_scheduled_requests,
        "tokens": stats.num_batched_tokens,
        "generated": stats.num_generation_tokens,
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "kv_usage": round(stats.kv_cache_usage, 4),
        "preempted": stats.num_preempted,
        "finished": len(stats.finished),
    }
    if spec is not None:
        rec["drafts_verified"] = spec.num_draft_tokens
        rec["requests_drafting"] = spec.num_drafts
        rec["drafts_accepted"] = spec.num_accepted_tokens
        rec["next_k"] = stats.spec_chosen_k
        rec["propose_s"] = round(stats.spec_propose_seconds, 5)
    if stats.spec_cost_estimates is not None:
        rec["cost_model"] = {k: round(v, 6) for k, v in stats.spec_cost_estimates.items()}
    return rec


class StepTrace:
    """Appends step records to a file; closed with the engine. A write error (disk full) turns the
    trace off with one log line: it must never stop the engine."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()  # the engine thread writes; shutdown closes from another thread

    def write(self, stats: IterationStats) -> None:
        if stats.num_scheduled_requests == 0:
            return  # a report of requests aborted between steps: no step ran
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(json.dumps(step_record(stats), separators=(",", ":")) + "\n")
            except OSError as e:
                logger.error("step trace %s: %s; tracing stops", self.path, e)
                self._close_locked()

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
