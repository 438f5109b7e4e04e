"""engine/malloc.py: fixed glibc thresholds stop the free-trim-refault cycle between engine steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Each "step" allocates three 900 KiB buffers, writes them and frees them, after one 1 MiB mmap'd
# chunk was freed (glibc then sets its mmap threshold to 1 MiB and its trim threshold to 2 MiB): the
# 2.7 MiB freed at the top of the heap exceed the trim threshold, so the default gives them back to the
# kernel after every step and the next step faults them in again; fixed thresholds keep them.
_PROBE = r"""
import ctypes, json, resource
from engine.malloc import tune_malloc
tune_malloc()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
p = libc.malloc(1 << 20); ctypes.memset(p, 1, 1 << 20); libc.free(p)
def step():
    bufs = [libc.malloc(900 << 10) for _ in range(3)]
    for b in bufs:
        ctypes.memset(b, 1, 900 << 10)
    for b in reversed(bufs):
        libc.free(b)
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    step()
print(json.dumps({"state": tune_malloc(), "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}))
"""


def _probe(choice: str) -> dict:
    env = {**os.environ, "SPECSERVE_MALLOC": choice}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_fixed_thresholds_stop_refaulting_between_steps() -> None:
    tuned, default = _probe("tuned"), _probe("default")
    assert tuned["state"].startswith("one arena, mmap threshold 32 MiB")
    assert default["state"].startswith("glibc default")
    # 50 steps x 2.7 MiB refaulted = ~34,000 faults with glibc's adaptive thresholds; none kept.
    assert default["faults"] > 10_000, default
    assert tuned["faults"] < 1_000, tuned


def test_bad_choice_is_refused() -> None:
    env = {**os.environ, "SPECSERVE_MALLOC": "jemalloc"}
    out = subprocess.run([sys.executable, "-c", "from engine import platform; platform.setup()"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "SPECSERVE_MALLOC='jemalloc'" in out.stderr
