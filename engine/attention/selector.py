"""Choosing the attention backend once at start-up (Metal kernels, the C kernel or the reference path), each
kernel set first checked against the reference path."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import mlx.core as mx

from engine.attention.reference import paged_attention_reference
from engine.attention.types import AttentionBackend, KernelSet
from engine.cpu import attention as cpu_attention
from engine.cpu.attention import cpu_paged_attention
from engine.kv.cache import PagedKVCache
from metal_kernels import ops as metal_ops

logger = logging.getLogger(__name__)


@functools.cache
def _self_test_failures(backend: str) -> tuple[str, ...]:
    """The built-in kernels' self-test, run once per process."""
    if backend == "metal":
        return tuple(metal_ops.self_test())
    return tuple(cpu_attention.self_test())


def _failed_self_test(name: str, backend: AttentionBackend, failures: list[str] | tuple[str, ...]
                      ) -> tuple[Callable[..., mx.array], str]:
    """A kernel set that failed its self-test: refused when named, else replaced by the reference path."""
    msg = f"the {name} attention kernels failed their start-up self-test: {'; '.join(failures)}"
    if backend == name:
        raise ValueError(f"--attention-backend {name}: {msg}; use auto or reference")
    logger.warning("%s; using the reference path (MLX ops) instead", msg)
    return paged_attention_reference, f"reference (MLX ops; {msg})"


def select_attention(backend: AttentionBackend, *, metal_available: bool | None = None,
                     metal_kernels: KernelSet | None = None, cpu_kernel: Callable[..., mx.array] | None = None
                     ) -> tuple[Callable[..., mx.array], str]:
    """The attention function for `--attention-backend` and a start-up label: `auto` takes Metal, else C,
    else the reference path; a failed self-test falls back under `auto`, refuses when named."""
    if backend not in ("auto", "metal", "cpu", "reference"):
        raise ValueError(f"attention_backend must be auto, metal, cpu or reference, not {backend!r}")
    if backend == "reference":
        return paged_attention_reference, "reference (MLX ops: KV gather + attention; forced)"
    metal = mx.metal.is_available() if metal_available is None else metal_available
    if backend == "metal" or (backend == "auto" and metal):
        if not metal:
            raise ValueError("--attention-backend metal needs an Apple GPU (mx.metal.is_available() is False "
                             "here); use auto or reference")
        failures = (_self_test_failures("metal") if metal_kernels is None
                    else metal_ops.self_test(metal_kernels))
        if failures:
            return _failed_self_test("metal", backend, failures)
        label = ("metal (paged_attention_decode / paged_attention_prefill kernels; prefill chunks over 128 "
                 "tokens on the gather path)")
        return metal_ops.paged_attention_metal, label
    why = cpu_attention.unsupported_reason()
    if why is None:
        failures = _self_test_failures("cpu") if cpu_kernel is None else cpu_attention.self_test(cpu_kernel)
        if failures:
            return _failed_self_test("cpu", backend, failures)
        return cpu_attention.cpu_paged_attention, "cpu (engine/cpu/attention.c over the paged cache)"
    if backend == "cpu":
        raise ValueError(f"--attention-backend cpu cannot run here: {why}; use auto or reference")
    return paged_attention_reference, f"reference (MLX ops: KV gather + attention; C kernel: {why})"


def cpu_attention_fits(kv: PagedKVCache) -> str | None:
    """Why the C attention cannot read this cache (None: it can)."""
    if not kv.head_major:
        return "the KV cache is block-major (the C kernel reads head-major)"
    if kv.dtype != mx.float32:
        return f"the KV cache holds {kv.dtype}, not float32"
    return None


def attention_for_cache(backend: AttentionBackend, kv: PagedKVCache) -> tuple[Callable[..., mx.array], str]:
    """`select_attention`, checked against the cache it will read: the C kernel falls back (or refuses when
    named) on a cache it cannot read, the Metal kernels refuse a head-major one."""
    attention_fn, label = select_attention(backend)
    if attention_fn is cpu_paged_attention and (why := cpu_attention_fits(kv)) is not None:
        if backend == "cpu":
            raise ValueError(f"--attention-backend cpu: {why}; use auto or reference")
        attention_fn, label = paged_attention_reference, f"reference (MLX ops; C kernel: {why})"
    if attention_fn not in (paged_attention_reference, cpu_paged_attention) and kv.head_major:
        raise ValueError("kv_layout=head: the Metal kernels read the block-major KV layout; "
                         "use kv_layout auto/block or --attention-backend reference")
    return attention_fn, label
