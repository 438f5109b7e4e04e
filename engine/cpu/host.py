"""Host access to MLX arrays for the C kernels: a zero-copy NumPy view and its address."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np


def host_view(a: mx.array) -> np.ndarray:
    """A zero-copy host view of an array, evaluated first; row-contiguous (16-bit floats as uint16)."""
    if a.dtype in (mx.bfloat16, mx.float16):
        a = a.view(mx.uint16)
    mx.eval(a)
    v = np.asarray(memoryview(a))
    if not v.flags.c_contiguous:
        raise ValueError("the C kernels need row-contiguous arrays")
    return v


def pointer(a: np.ndarray) -> ctypes.c_void_p:
    """The address of a NumPy array's data, for a ctypes call."""
    return ctypes.c_void_p(a.ctypes.data)
