"""Host access to MLX arrays: a zero-copy NumPy view and its address (for the C kernels), and typed
`tolist()` conversions."""

from __future__ import annotations

import ctypes
from typing import cast

import mlx.core as mx
import numpy as np


def host_view(a: mx.array) -> np.ndarray:
    """A zero-copy host view of an array, evaluated first; row-contiguous (16-bit floats as uint16)."""
    if a.dtype in (mx.bfloat16, mx.float16):
        a = a.view(mx.uint16)
    mx.eval(a)
    v = np.asarray(memoryview(a))  # type: ignore[arg-type]  # stub lacks mx.array's buffer protocol
    if not v.flags.c_contiguous:
        raise ValueError("the C kernels need row-contiguous arrays")
    return v


def pointer(a: np.ndarray) -> ctypes.c_void_p:
    """The address of a NumPy array's data, for a ctypes call."""
    return ctypes.c_void_p(a.ctypes.data)


# `mx.array.tolist()` is typed as any depth: these name the shape the caller knows.
def int_list(a: mx.array) -> list[int]:
    """A 1-D integer array's `tolist()`."""
    return cast("list[int]", a.tolist())


def float_list(a: mx.array) -> list[float]:
    """A 1-D floating-point array's `tolist()`."""
    return cast("list[float]", a.tolist())


def bool_list(a: mx.array) -> list[bool]:
    """A 1-D boolean array's `tolist()`."""
    return cast("list[bool]", a.tolist())


def int_rows(a: mx.array) -> list[list[int]]:
    """A 2-D integer array's `tolist()`."""
    return cast("list[list[int]]", a.tolist())


def float_rows(a: mx.array) -> list[list[float]]:
    """A 2-D floating-point array's `tolist()`."""
    return cast("list[list[float]]", a.tolist())
