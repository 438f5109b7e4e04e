"""engine/cpu/attention.c: the CPU's paged attention in C, against an independent NumPy reference, its
batch invariance (a row's output does not depend on the rest of the step) and its selection rules."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from engine.attention.reference import paged_attention_reference
from engine.attention.selector import select_attention
from engine.attention.types import build_metadata
from engine.cpu.attention import cpu_paged_attention, unsupported_reason
from engine.kv.cache import PagedKVCache
from tests.kernels.test_metal_kernels import _dense_reference, _scenario

WHY = unsupported_reason()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"the C attention cannot run here: {WHY}")

# Decode rows, verification rows, a long prefill chunk, a first token, a context past 300 keys.
MIX = [(9, 1), (20, 3), (40, 1), (5, 25), (16, 5), (1, 1), (30, 3), (0, 1), (300, 1)]


def _head_major(a: mx.array) -> mx.array:
    nb, bs, hkv, d = a.shape
    return mx.contiguous(a.reshape(nb * bs, hkv, d).transpose(1, 0, 2))


@needs_kernel
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("bs", "d", "heads", "kv_heads"), [(16, 64, 9, 3), (8, 128, 4, 2), (16, 32, 4, 4),
                                                     (16, 80, 4, 2), (16, 256, 2, 1)])
def test_matches_the_dense_reference(window: int | None, bs: int, d: int, heads: int, kv_heads: int,
                                     isa: str) -> None:
    q, kb, vb, meta, chunks = _scenario(7, bs, d, MIX, num_heads=heads, num_kv_heads=kv_heads)
    got = np.array(cpu_paged_attention(q, _head_major(kb), _head_major(vb), meta, 0.125, window, isa=isa))
    want = _dense_reference(q, kb, vb, chunks, 0.125, 0.0, window or 0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@needs_kernel
def test_each_row_is_bitwise_what_it_gets_alone(isa: str) -> None:
    """Why greedy verification stays exact: a token attended inside a mixed step (verifying drafts
    beside other requests' decode rows and a prefill chunk) gets bitwise the output of the same token
    decoded alone."""
    q, kb, vb, meta, chunks = _scenario(11, 16, 64, MIX, num_heads=9, num_kv_heads=3)
    kh, vh = _head_major(kb), _head_major(vb)
    batch = np.array(cpu_paged_attention(q, kh, vh, meta, 0.125, isa=isa))
    t = 0
    for start, n, table in chunks:
        for j in range(n):
            alone = build_metadata([(start + j, 1, table)], 16)
            one = np.array(cpu_paged_attention(q[t : t + 1], kh, vh, alone, 0.125, isa=isa))
            assert np.array_equal(one[0], batch[t]), f"token {t} (position {start + j}) differs"
            t += 1


@needs_kernel
def test_long_chunks_split_over_threads_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with over ~1 ms of attention (a long prefill chunk) is shared between threads: the output
    is the dense reference's, and bitwise the one-thread output."""
    import engine.cpu.attention as ca

    q, kb, vb, meta, chunks = _scenario(5, 16, 64, [(600, 64), (30, 1), (200, 5)], num_heads=9,
                                        num_kv_heads=3)
    host = meta.host()
    assert sum(host.positions + 1) * 9 * 64 > 1e7  # past the C code's threading threshold
    kh, vh = _head_major(kb), _head_major(vb)
    threaded = np.array(cpu_paged_attention(q, kh, vh, meta, 0.125))
    np.testing.assert_allclose(threaded, _dense_reference(q, kb, vb, chunks, 0.125), rtol=2e-5, atol=2e-6)
    monkeypatch.setattr(ca.cpu_threads(), "fixed", 1)
    assert np.array_equal(np.array(cpu_paged_attention(q, kh, vh, meta, 0.125)), threaded)


@needs_kernel
def test_engine_step_matches_the_reference_backend() -> None:
    """The engine's own cache writes and metadata through both backends: one forward of a mixed step
    gives the same hidden states to float32 rounding."""
    from tests.helpers import make_llm

    llm = make_llm(attention_backend="cpu")
    runner = llm.core.runner
    assert runner.caches[0].attention_fn is cpu_paged_attention
    chunks = [(list(range(300, 340)), 0, [1, 2, 3], 1), (list(range(500, 520)), 0, [4, 5], 1)]
    runner.forward_chunks(chunks)  # prefill both
    step = [(list(range(340, 345)), 40, [1, 2, 3], 5), ([520], 20, [4, 5], 1)]
    outs = []
    for fn in (cpu_paged_attention, paged_attention_reference):
        for c in runner.caches:
            c.attention_fn = fn
        outs.append(np.array(runner.forward_chunks(step)))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_selection_and_refusals(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from tests.helpers import make_llm

    if WHY is not None:
        pytest.skip(f"the C attention cannot run here: {WHY}")
    # The kernel reads float32 head-major caches only: a block-major one is refused when forced, and
    # `auto` says why it runs the reference path instead.
    with pytest.raises(ValueError, match="block-major"):
        make_llm(attention_backend="cpu", kv_layout="block")
    with caplog.at_level(logging.INFO, logger="engine.core"):
        llm = make_llm(kv_layout="block")
    assert llm.core.runner.caches[0].attention_fn is paged_attention_reference
    assert any("C kernel: the KV cache is block-major" in r.getMessage() for r in caplog.records)


@needs_kernel
def test_refuses_what_it_cannot_compute() -> None:
    cache = PagedKVCache([(2, 24)], 4, 16, mx.float32, head_major=True)  # head_dim 24: not a multiple of 16
    meta = build_metadata([(0, 1, [0])], 16)
    with pytest.raises(ValueError, match="unsupported"):
        cpu_paged_attention(mx.zeros((1, 4, 24)), cache.k[0], cache.v[0], meta, 0.2)


@needs_kernel
def test_self_test_passes_and_the_kernel_is_selected() -> None:
    from engine.cpu import attention as cpu_attention

    assert cpu_attention.self_test() == []
    assert select_attention("auto")[0] is cpu_paged_attention


def _shifted(*args: object) -> mx.array:
    return cpu_paged_attention(*args) + 1e-2  # type: ignore[arg-type]


def _raises(*args: object) -> mx.array:
    raise MemoryError("cpu_paged_attention could not allocate its scratch memory")


@needs_kernel
@pytest.mark.parametrize("kernel", [_shifted, _raises], ids=["mismatch", "error"])
def test_failing_kernel_falls_back_or_refuses(kernel, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """A C kernel that disagrees with the reference path (a miscompile, a CPU bug) or fails on the
    start-up case: `auto` logs it and runs the reference path, `--attention-backend cpu` refuses."""
    with caplog.at_level(logging.WARNING, logger="engine.attention.selector"):
        fn, label = select_attention("auto", cpu_kernel=kernel)
    assert fn is paged_attention_reference and "cpu_paged_attention (window None)" in label
    assert any("self-test" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="--attention-backend cpu: the cpu attention kernels failed"):
        select_attention("cpu", cpu_kernel=kernel)
