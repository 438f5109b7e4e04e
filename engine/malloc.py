"""One malloc arena with fixed thresholds for MLX's CPU backend (glibc), against a per-step mmap / munmap
cycle (docs/cpu-backend.md). `SPECSERVE_MALLOC`: `tuned` (default) or `default`."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from engine import envs

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 256 * 2**20

_state: str | None = None


def tune_malloc() -> str:
    """Apply the single arena and fixed thresholds once; returns what was done (for the start-up log)."""
    global _state
    if _state is not None:
        return _state
    choice = envs.get("SPECSERVE_MALLOC")
    if choice == "default":
        _state = "glibc default (SPECSERVE_MALLOC=default)"
    elif not sys.platform.startswith("linux"):
        _state = "not glibc: unchanged"
    else:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt  # musl and other libcs have none
        except (OSError, AttributeError):
            _state = "no mallopt: unchanged"
        else:
            ok = (mallopt(_M_ARENA_MAX, 1) == 1 and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                  and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
            _state = ("one arena, mmap threshold 32 MiB, trim threshold 256 MiB" if ok
                      else "mallopt refused the thresholds: unchanged")
    return _state
