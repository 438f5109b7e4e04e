"""4-bit weights dotted with 8-bit activations (engine/cpu/qgemm.c, `qgemm_i8`): bitwise equal to a NumPy
model of the same arithmetic (each row quantized alone per 32 values, integer dots in 8 lanes, one FMA per
lane and block, the bias term in block order, one fixed horizontal sum) at every row count 1..256, for
every group size and scale dtype, threaded or not: so a row in a batch is bitwise the row alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cpu import qgemm
from engine.cpu.qgemm import PackedWeights, qgemm_host
from tests.kernels.test_qgemm import _host

WHY = qgemm.unsupported_reason()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"qgemm cannot run here: {WHY}")
F32 = np.float32


def quantize_rows(a: np.ndarray, shared: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[M, K] -> int q [M, K/32, 32] (natural order), d and d * sum(q) [M, K/32] as float32. `shared`: one
    scale per block across the batch (what the kernel must not do)."""
    m, k = a.shape
    x = a.reshape(m, k // 32, 32).astype(F32)
    amax = np.abs(x).max(axis=2)
    if shared:
        amax = np.broadcast_to(amax.max(axis=0), amax.shape)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint((x * inv[:, :, None]).astype(F32)).astype(np.int64)  # ties to even, as lrintf
    return q, d, (d * q.sum(axis=2).astype(F32)).astype(F32)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add: exact product and sum in extended precision, rounded once."""
    ld = np.longdouble
    return (a.astype(ld) * b.astype(ld) + c.astype(ld)).astype(F32)


def reference(a: np.ndarray, pw: PackedWeights, words: np.ndarray, scales: np.ndarray,
              biases: np.ndarray, shared: bool = False) -> np.ndarray:
    q, d, s = quantize_rows(a, shared)
    m, nb = d.shape
    n, group = pw.n, pw.group
    shifts = (np.arange(8, dtype=np.uint64) * 4)[None, None, :]
    w = ((words.astype(np.uint64)[:, :, None] >> shifts) & 15).reshape(n, nb, 32).astype(np.int64)
    # The kernel's byte order in a block: the 16 even elements, then the 16 odd ones; lane l sums 4 bytes.
    order = np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2)])
    wl, ql = w[:, :, order].reshape(n, nb, 8, 4), q[:, :, order].reshape(m, nb, 8, 4)
    acc = np.zeros((2, m, n, 8), F32)  # even blocks, odd blocks
    for b in range(nb):
        g = b * 32 // group
        dots = np.einsum("mlt,nlt->mnl", ql[:, b], wl[:, b]).astype(F32)
        scale = (scales[None, :, g] * d[:, b, None]).astype(F32)
        acc[b % 2] = fma32(dots, np.broadcast_to(scale[:, :, None], dots.shape), acc[b % 2])
    # Bias terms: 8 lanes, block b in lane b % 8, blocks zero-padded to a multiple of 8.
    nbp = (nb + 7) // 8 * 8
    bias_b = np.zeros((n, nbp), F32)
    bias_b[:, :nb] = np.repeat(biases, group // 32, axis=1)
    s_p = np.zeros((m, nbp), F32)
    s_p[:, :nb] = s
    lanes = np.zeros((m, n, 8), F32)
    for c in range(0, nbp, 8):
        lanes = fma32(np.broadcast_to(bias_b[None, :, c:c + 8], lanes.shape),
                      np.broadcast_to(s_p[:, None, c:c + 8], lanes.shape), lanes)
    return hsum8((acc[0] + acc[1]).astype(F32)) + hsum8(lanes)


def hsum8(a: np.ndarray) -> np.ndarray:
    v = a[..., :4] + a[..., 4:]
    return (v[..., 0] + v[..., 2]) + (v[..., 1] + v[..., 3])


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_bitwise_equal_to_the_integer_model_every_row_count(group: int, scale_dtype: mx.Dtype,
                                                            isa: str) -> None:
    n, k = 37, 256
    rng = np.random.default_rng(group)
    wq, sc, bi = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(scale_dtype),
                             group_size=group, bits=4)
    pw = PackedWeights.affine(wq, sc, bi, group, 4)
    assert pw.int8_serves()
    a = rng.standard_normal((256, k)).astype(np.float32) * rng.uniform(0.01, 10, (256, 1)).astype(np.float32)
    a[3, :32] = 0.0  # an all-zero block: scale 0
    want = reference(a, pw, np.array(wq), _host(sc).astype(F32), _host(bi).astype(F32))
    for m in range(1, 257):
        got = qgemm_host(a[:m], pw, max_threads=1 + m % 2, isa=isa, int8=True)
        np.testing.assert_array_equal(got, want[:m], err_msg=f"{m} rows")
    # Close to the float product too (8-bit activations lose ~0.4% of each block's range).
    exact = qgemm_host(a, pw, isa=isa)
    assert np.abs(want - exact).max() <= 0.02 * np.abs(exact).max()


def test_a_batch_quantized_with_one_shared_scale_is_caught(isa: str) -> None:
    """Row 0 beside a row 50 times larger is row 0 alone; a batch quantized with shared block scales is
    not, so the check above would catch such a kernel."""
    n, k = 16, 64
    rng = np.random.default_rng(0)
    wq, sc, bi = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)), group_size=32, bits=4)
    pw = PackedWeights.affine(wq, sc, bi, 32, 4)
    a = rng.standard_normal((2, k)).astype(np.float32)
    a[1] *= 50
    args = (pw, np.array(wq), _host(sc).astype(F32), _host(bi).astype(F32))
    alone = reference(a[:1], *args)
    np.testing.assert_array_equal(qgemm_host(a, pw, isa=isa, int8=True)[:1], alone)
    assert not np.array_equal(reference(a, *args, shared=True)[:1], alone)


def reference_q8(a: np.ndarray, words: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                 group: int) -> np.ndarray:
    """8-bit weights: v = u - 128 dotted with the natural-order q per block in 8 lanes, one FMA a lane with
    s * d; the bias terms (b + 128 s) * d * sum(q) in block order."""
    q, d, s = quantize_rows(a)
    m, nb = d.shape
    n = words.shape[0]
    v = (words.view(np.uint8).reshape(n, nb, 32).astype(np.int64) - 128)
    sc = np.repeat(scales, group // 32, axis=1).astype(F32)
    bb = (np.repeat(biases, group // 32, axis=1).astype(F32) + (F32(128) * sc).astype(F32)).astype(F32)
    dots = np.einsum("mblt,nblt->mnbl", q.reshape(m, nb, 8, 4), v.reshape(n, nb, 8, 4)).astype(F32)
    acc = np.zeros((2, m, n, 8), F32)
    for b in range(nb):
        scale = np.broadcast_to((sc[None, :, b] * d[:, b, None]).astype(F32)[:, :, None], (m, n, 8))
        acc[b % 2] = fma32(dots[:, :, b], scale, acc[b % 2])
    nbp = (nb + 7) // 8 * 8
    bb_p, s_p = np.zeros((n, nbp), F32), np.zeros((m, nbp), F32)
    bb_p[:, :nb], s_p[:, :nb] = bb, s
    lanes = np.zeros((m, n, 8), F32)
    for c in range(0, nbp, 8):
        lanes = fma32(np.broadcast_to(bb_p[None, :, c:c + 8], lanes.shape),
                      np.broadcast_to(s_p[:, None, c:c + 8], lanes.shape), lanes)
    return hsum8((acc[0] + acc[1]).astype(F32)) + hsum8(lanes)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32])
def test_8bit_weights_bitwise_equal_to_the_integer_model_every_row_count(group: int, scale_dtype: mx.Dtype,
                                                                         isa: str) -> None:
    n, k = 21, 288 if group == 32 else 256  # an odd block count at group 32: the unpaired last block
    rng = np.random.default_rng(8 + group)
    wq, sc, bi = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(scale_dtype),
                             group_size=group, bits=8)
    pw = PackedWeights.affine(wq, sc, bi, group, 8)
    assert pw.int8_serves()
    a = rng.standard_normal((256, k)).astype(np.float32) * rng.uniform(0.01, 10, (256, 1)).astype(np.float32)
    a[5, 32:64] = 0.0
    want = reference_q8(a, np.array(wq), _host(sc).astype(F32), _host(bi).astype(F32), group)
    for m in range(1, 257):
        got = qgemm_host(a[:m], pw, max_threads=1 + m % 2, isa=isa, int8=True)
        np.testing.assert_array_equal(got, want[:m], err_msg=f"{m} rows")
    exact = qgemm_host(a, pw, isa=isa)
    assert np.abs(want - exact).max() <= 0.02 * np.abs(exact).max()


def test_refuses_what_it_does_not_serve() -> None:
    rng = np.random.default_rng(0)
    # Groups of 96: the float kernels read them, the int8 ones take 32 times a power of two only.
    for bits in (4, 8):
        w = mx.array(rng.integers(0, 2**32, (8, 192 * bits // 32), dtype=np.uint32))
        scales, biases = mx.ones((8, 2)), mx.zeros((8, 2))
        odd = PackedWeights.affine(w, scales, biases, 96, bits)
        assert odd.supported() and not odd.int8_serves()
        with pytest.raises(ValueError, match="refused"):
            qgemm_host(np.ones((1, 192), np.float32), odd, int8=True)
    bf = PackedWeights.floats(mx.ones((8, 64), dtype=mx.bfloat16))
    assert not bf.int8_serves()
    with pytest.raises(ValueError, match="refused"):
        qgemm_host(np.ones((1, 64), np.float32), bf, int8=True)
