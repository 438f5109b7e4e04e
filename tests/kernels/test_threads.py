"""engine/cpu/threads.py: the kernels' thread count follows the other processes' load (a real busy loop
beside this one), `--cpu-threads` pins it, and listeners hear every change."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from engine.cpu import threads as cthreads
from engine.cpu.threads import CpuThreads

BUSY = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")


def _settle(t: CpuThreads, seconds: float) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t.count()
        time.sleep(0.05)
    return t.count()


def _busy_loop(nice: int = 0) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=lambda: os.nice(nice))


def test_a_busy_neighbour_takes_a_cpu_and_gives_it_back() -> None:
    t = CpuThreads(cpus=8)  # counted against 8 CPUs: one busy neighbour must take exactly one
    heard: list[int] = []
    t.on_change(heard.append)
    base = _settle(t, 1.2)
    if base < 8:
        pytest.skip(f"other processes keep {t.others:.1f} CPUs busy here; the test needs a quiet machine")
    loop = _busy_loop()
    try:
        assert _settle(t, 1.5) == 7 and t.others > 0.6
    finally:
        loop.kill()
        loop.wait()
    assert _settle(t, 1.5) == 8
    assert heard[0] == 8 and 7 in heard and heard[-1] == 8


def test_a_niced_neighbour_is_not_counted() -> None:
    """A niced process gives its core back as soon as a kernel thread wakes: no CPU is given up to it."""
    if os.nice(0) > 0:
        pytest.skip("this process is niced itself")
    t = CpuThreads(cpus=8)
    if _settle(t, 1.2) < 8:
        pytest.skip(f"other processes keep {t.others:.1f} CPUs busy here; the test needs a quiet machine")
    loop = _busy_loop(nice=19)
    try:
        assert _settle(t, 1.5) == 8 and t.others < 0.4
    finally:
        loop.kill()
        loop.wait()


def test_load_seen_while_idle_is_not_held_against_the_next_burst() -> None:
    """Another server that decoded while this one waited costs the next request nothing: after idle time
    the count starts again from every CPU (it took a thread for the first half second of each request)."""
    t = CpuThreads(cpus=8)
    if _settle(t, 1.2) < 8:
        pytest.skip(f"other processes keep {t.others:.1f} CPUs busy here; the test needs a quiet machine")
    loops = [_busy_loop(), _busy_loop()]
    try:
        time.sleep(1.5)  # idle: no kernel call asks for a count
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert t.count() == 8


def test_fixed_count_is_kept_whatever_the_load() -> None:
    t = CpuThreads(fixed=3, cpus=2)
    assert t.count() == 3
    loop = _busy_loop()
    try:
        assert _settle(t, 0.6) == 3
    finally:
        loop.kill()
        loop.wait()


def test_configure_pins_and_refuses_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cthreads, "_threads", None)
    assert cthreads.configure(1).count() == 1
    with pytest.raises(ValueError, match="at least 1"):
        cthreads.configure(0)
    assert cthreads.configure(None).fixed is None
