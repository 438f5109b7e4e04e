"""How many threads the C kernels use: `--cpu-threads`, or the CPUs no other process is busy on, re-read
from /proc/stat at most every quarter second (docs/cpu-backend.md#threads-beside-other-processes)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)
REFRESH_S = 0.25
STALE_S = 1.0
_STAT = Path("/proc/stat")


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _busy_seconds(count_nice: bool) -> float | None:
    """CPU seconds used by all processes, or None without /proc/stat. Niced user time counts only when
    `count_nice`: a niced neighbour yields its core to our threads at once."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    ticks = user + system + irq + softirq + steal + (nice if count_nice else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CpuThreads:
    """The thread count for the next kernel call (`count()`); `fixed` pins it."""

    def __init__(self, fixed: int | None = None, cpus: int | None = None) -> None:
        self.cpus = cpus or usable_cpus()
        self.fixed = fixed
        self._lock = threading.Lock()
        self._count = fixed or self.cpus
        self._others = 0.0  # CPUs other processes kept busy, smoothed
        self._last: tuple[float, float, float] | None = None  # (wall, all busy, ours)
        self._listeners: list[Callable[[int], object]] = []

    def count(self) -> int:
        if self.fixed is not None:
            return self.fixed
        now = time.monotonic()
        last = self._last
        if last is not None and now - last[0] < REFRESH_S:
            return self._count
        with self._lock:
            self._sample(now)
        return self._count

    def _sample(self, now: float) -> None:
        busy = _busy_seconds(os.nice(0) > 0)
        if busy is None:
            return
        own = _own_seconds()
        last, self._last = self._last, (now, busy, own)
        if last is None or now - last[0] > STALE_S:
            # After idle time the load says nothing about now: start again from all CPUs.
            self._others = 0.0
            self.set_count(self.cpus)
            return
        if now <= last[0]:
            return
        others = max(0.0, ((busy - last[1]) - (own - last[2])) / (now - last[0]))
        self._others = 0.5 * self._others + 0.5 * others
        # A CPU goes to the others once they keep ~0.6 of one busy.
        self.set_count(max(1, self.cpus - int(self._others + 0.4)))

    def set_count(self, n: int) -> None:
        if n != self._count:
            logger.debug("CPU kernel threads: %d (other processes keep %.2f CPUs busy)", n, self._others)
            self._count = n
            for fn in self._listeners:
                fn(n)

    def on_change(self, fn: Callable[[int], object]) -> None:
        """Call fn(count) whenever the count changes (the small-M GEMM keeps its own copy)."""
        self._listeners.append(fn)
        fn(self.count())

    @property
    def others(self) -> float:
        return self._others


_threads: CpuThreads | None = None


def cpu_threads() -> CpuThreads:
    """The process's one thread policy (adaptive until `configure` pins it)."""
    global _threads
    if _threads is None:
        _threads = CpuThreads()
    return _threads


def configure(fixed: int | None) -> CpuThreads:
    """`--cpu-threads N` (None: adapt to the other processes' load)."""
    if fixed is not None and fixed < 1:
        raise ValueError(f"--cpu-threads must be at least 1 (got {fixed})")
    t = cpu_threads()
    t.fixed = fixed
    t.set_count(fixed or t.cpus)
    return t
