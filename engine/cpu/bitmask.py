"""Grammar masks applied to logits rows in place (bitmask.c, portable C), with a NumPy fallback where no C
compiler is found (docs/structured-outputs.md)."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np

from engine.cpu.build import build_library

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("bitmask.c")
_FLAGS = ["-O3", "-fPIC", "-shared"]  # no CPU-specific flags


@functools.cache
def _lib() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build_library(SOURCE, "bitmask", _FLAGS)))
    except (RuntimeError, OSError) as e:
        logger.warning("grammar masks in NumPy (engine/cpu/bitmask.c not built: %s)", e)
        return None
    fn = lib.apply_bitmask
    fn.restype = None
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [p, ctypes.c_long, p, i, i, i]
    return lib


def prepare() -> None:
    """Build (or find) the C library now, off the engine thread (the first grammar compile calls this)."""
    _lib()


def apply_bitmask(rows: np.ndarray, masks: np.ndarray, use_c: bool = True) -> None:
    """rows: float32 [n, vocab] (contiguous, a view into the step's logits), set in place; masks: int32 [n,
    words] allowed-token bits."""
    n, vocab = rows.shape
    masks = np.ascontiguousarray(masks, dtype=np.int32)
    lib = _lib() if use_c else None
    if lib is not None and rows.dtype == np.float32 and rows.strides[1] == 4:
        lib.apply_bitmask(rows.ctypes.data, rows.strides[0] // 4, masks.ctypes.data, masks.shape[1], n, vocab)
        return
    allowed = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little", count=vocab)
    rows[allowed == 0] = -np.inf
