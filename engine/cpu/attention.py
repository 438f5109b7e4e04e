"""Paged attention in C (attention.c), the CPU's default backend: reads the float32 head-major cache through
the block tables between MLX graphs, each output computed the same way whatever else is in the step
(docs/cpu-backend.md)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.attention.reference import paged_attention_reference, random_case, reference_mismatch
from engine.attention.types import AttentionMetadata
from engine.cpu.build import build_kernel, cpu_kernel_reason, selected_isa
from engine.cpu.host import host_view, pointer
from engine.cpu.threads import cpu_threads

SOURCE = Path(__file__).with_name("attention.c")


def unsupported_reason(isa: str | None = None) -> str | None:
    """Why the C attention cannot run here (None: it can). The cache layout is checked by the engine."""
    return cpu_kernel_reason(lambda: _lib(isa), "engine/cpu/attention.c", isa)


def _lib(isa: str | None = None) -> ctypes.CDLL:
    return _lib_for(isa or selected_isa())


@functools.cache
def _lib_for(isa: str | None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_kernel(SOURCE, "cpu_attention", isa)))
    fn = lib.cpu_paged_attention
    fn.restype = ctypes.c_int
    i, p = ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [i, i, i, i, p, p, p, ctypes.c_long, p, p, p, i, i, ctypes.c_float, i, i, p]
    return lib


def cpu_paged_attention(
    q: mx.array,  # [T, H, D]
    k_cache: mx.array,  # head-major [Hkv, slots, D], the new rows written
    v_cache: mx.array,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    isa: str | None = None,
) -> mx.array:  # [T, H, D]
    """Same contract as `paged_attention_reference` on a float32 head-major cache."""
    t, h, d = q.shape
    hkv, slots, _ = k_cache.shape
    if d % 16 or h % hkv or q.dtype != mx.float32 or k_cache.dtype != mx.float32:
        raise ValueError(f"cpu_paged_attention: unsupported shapes/dtypes q {q.shape} {q.dtype}, "
                         f"cache {k_cache.shape} {k_cache.dtype}")
    q = mx.contiguous(q)
    mx.eval(q, k_cache, v_cache)
    host = meta.host()
    out = np.empty((t, h, d), dtype=np.float32)
    rc = _lib(isa).cpu_paged_attention(
        t, h, hkv, d, *(pointer(host_view(a)) for a in (q, k_cache, v_cache)), slots,
        *(pointer(a) for a in (host.positions, host.token_table, host.tables)), host.block_size, window or 0,
        scale, host.max_context, cpu_threads().count(), pointer(out))
    if rc != 0:
        raise MemoryError("cpu_paged_attention could not allocate its scratch memory")
    return mx.array(out)


def self_test(kernel: Callable[..., mx.array] = cpu_paged_attention) -> list[str]:
    """Run the C attention once on a small random step against the reference path -> one line per failure
    (empty: passed). `kernel`: what to test (tests pass stand-ins)."""
    q, kc, vc, meta = random_case([(5, 1), (20, 1), (33, 3), (7, 20)], block_size=16, head_dim=64,
                                  num_heads=4, num_kv_heads=2, head_major=True)
    failures = []
    for window in (None, 24):
        try:
            why = reference_mismatch(kernel(q, kc, vc, meta, 0.125, window),
                                     paged_attention_reference(q, kc, vc, meta, 0.125, window), 2e-4)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        if why:
            failures.append(f"cpu_paged_attention (window {window}): {why}")
    return failures
