"""GGML's block formats served as stored (engine/cpu/blocks.h): Q5_0, Q5_1, Q4_K, Q5_K, Q6_K rows dequantize
bitwise as the gguf package does, and their products with 8-bit activations are bitwise a NumPy model of the
same integer arithmetic at every row count 1..256, threaded or not (so a row in a batch is the row alone)."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest

from engine.cpu import qgemm
from engine.cpu.qgemm import BLOCK_FORMATS, BlockWeights, block_rows_host, blocks_host
from tests.kernels.test_qgemm_int8 import F32, fma32, hsum8, quantize_rows

WHY = qgemm.unsupported_reason()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"qgemm cannot run here: {WHY}")
# Byte offsets of each format's float16 fields in its block.
_F16_FIELDS = {"Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] of random integers and scales (the float16 fields finite, of either sign)."""
    _, per, size = BLOCK_FORMATS[qtype]
    blocks = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        values = (rng.standard_normal((n, k // per)) * 0.05).astype(np.float16)
        blocks[:, :, at:at + 2] = values.view(np.uint8).reshape(n, k // per, 2)
    return blocks.reshape(n, -1)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(F32)


def unpack(qtype: str, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> u [n, k] (the unsigned integers, in order), and each weight's scale and bias [n, params]: per 32
    weights, per 16 for Q6_K (w = s * u + b)."""
    _, per, size = BLOCK_FORMATS[qtype]
    n = rows.shape[0]
    blk = rows.reshape(n, k // per, size)
    if qtype in ("Q5_0", "Q5_1"):
        at = 2 if qtype == "Q5_0" else 4
        qh = blk[:, :, at:at + 4].copy().view(np.uint32)[..., 0]
        qs = blk[:, :, at + 4:]
        high = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        u = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.int64) | (high.astype(np.int64) << 4)
        s = _f16(blk, 0)
        b = -16 * s if qtype == "Q5_0" else _f16(blk, 2)
        return u.reshape(n, k), s, b.astype(F32)
    if qtype == "Q6_K":
        ql, qh = blk[:, :, :128].reshape(n, -1, 2, 64), blk[:, :, 128:192].reshape(n, -1, 2, 32)
        parts = []
        for r in range(4):  # per 128: ql's half r & 1, its nibble r >> 1, qh bits 2r, 2r + 1
            lo = (ql[:, :, :, 32 * (r & 1):32 * (r & 1) + 32] >> (4 * (r >> 1))) & 15
            parts.append(lo | (((qh >> (2 * r)) & 3) << 4))
        u = np.stack(parts, axis=3).astype(np.int64)  # [n, super, half, r, 32]
        s = (_f16(blk, 208)[..., None] * blk[:, :, 192:208].view(np.int8).astype(F32)).astype(F32)
        return u.reshape(n, k), s.reshape(n, -1), (F32(-32) * s).reshape(n, -1).astype(F32)
    sc, mins = gguf.quants.Q4_K.get_scale_min(blk[:, :, 4:16].reshape(-1, 12))
    sc, mins = sc.reshape(n, -1, 8).astype(F32), mins.reshape(n, -1, 8).astype(F32)
    qs = blk[:, :, 16:144] if qtype == "Q4_K" else blk[:, :, 48:176]
    qs = qs.reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    u = (qs & 15).reshape(n, -1, 8, 32).astype(np.int64)
    if qtype == "Q5_K":
        qh = blk[:, :, 16:48]
        bits = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
        u |= bits.astype(np.int64) << 4
    s = (_f16(blk, 0)[..., None] * sc).astype(F32)
    b = -(_f16(blk, 2)[..., None] * mins).astype(F32)
    return u.reshape(n, k), s.reshape(n, -1), b.reshape(n, -1)


def reference(a: np.ndarray, qtype: str, rows: np.ndarray) -> np.ndarray:
    m, k = a.shape
    n, nb = rows.shape[0], k // 32
    u, ws, wb = unpack(qtype, rows, k)
    q, d, s = quantize_rows(a)  # natural order per 32
    halves = qtype == "Q6_K"
    dots = np.einsum("mblt,nblt->mnbl", q.reshape(m, nb, 8, 4), u.reshape(n, nb, 8, 4)).astype(F32)
    acc = np.zeros((2, m, n, 8), F32)
    for b in range(nb):
        if halves:  # lanes 0-3: the first 16 weights' scale, 4-7 the second's
            per_lane = np.repeat(ws[:, 2 * b:2 * b + 2], 4, axis=1)  # [n, 8]
            scale = (per_lane[None, :, :] * d[:, b, None, None]).astype(F32)
        else:
            scale = np.broadcast_to((ws[None, :, b] * d[:, b, None]).astype(F32)[:, :, None], (m, n, 8))
        acc[b % 2] = fma32(dots[:, :, b], scale, acc[b % 2])
    if halves:
        sums = q.reshape(m, nb, 2, 16).sum(axis=3).astype(F32)
        xs = (d[:, :, None] * sums).reshape(m, -1).astype(F32)
    else:
        xs = s
    npar = -(-xs.shape[1] // 8) * 8
    wb_p, xs_p = np.zeros((n, npar), F32), np.zeros((m, npar), F32)
    wb_p[:, :wb.shape[1]], xs_p[:, :xs.shape[1]] = wb, xs
    lanes = np.zeros((m, n, 8), F32)
    for c in range(0, npar, 8):
        lanes = fma32(np.broadcast_to(wb_p[None, :, c:c + 8], lanes.shape),
                      np.broadcast_to(xs_p[:, None, c:c + 8], lanes.shape), lanes)
    return hsum8((acc[0] + acc[1]).astype(F32)) + hsum8(lanes)


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_rows_dequantize_as_the_gguf_package_does(qtype: str, isa: str) -> None:
    n, k = 9, 512
    rows = random_blocks(qtype, n, k, np.random.default_rng(1))
    bw = BlockWeights.of(qtype, mx.array(rows), k)
    want = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[qtype]).reshape(n, k)
    ids = np.array([3, 0, 8, 3])
    np.testing.assert_array_equal(block_rows_host(ids, bw, isa=isa), want[ids])
    u, ws, wb = unpack(qtype, rows, k)  # the test's own unpacking agrees with the package
    per = k // ws.shape[1]
    off = {"Q5_0": 16, "Q6_K": 32}.get(qtype)
    s, b = np.repeat(ws, per, axis=1), np.repeat(wb, per, axis=1)
    if off:
        mine = (s * (u - off).astype(F32)).astype(F32)
    else:
        mine = ((s * u.astype(F32)).astype(F32) + b).astype(F32)
    np.testing.assert_array_equal(mine, want)


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_bitwise_equal_to_the_integer_model_every_row_count(qtype: str, isa: str) -> None:
    n, k = 21, 512 + (0 if BLOCK_FORMATS[qtype][1] == 256 else 96)
    rng = np.random.default_rng(BLOCK_FORMATS[qtype][0])
    rows = random_blocks(qtype, n, k, rng)
    bw = BlockWeights.of(qtype, mx.array(rows), k)
    a = rng.standard_normal((256, k)).astype(np.float32) * rng.uniform(0.01, 10, (256, 1)).astype(np.float32)
    a[3, :32] = 0.0  # an all-zero block: scale 0
    want = reference(a, qtype, rows)
    for m in range(1, 257):
        got = blocks_host(a[:m], bw, max_threads=1 + m % 2, isa=isa)
        np.testing.assert_array_equal(got, want[:m], err_msg=f"{m} rows")
    # Close to the product of the dequantized weights (8-bit activations lose ~0.4% of a block's range).
    exact = a @ gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[qtype]).reshape(n, k).T
    assert np.abs(want - exact).max() <= 0.02 * np.abs(exact).max()


def test_refuses_what_it_does_not_serve() -> None:
    rows = random_blocks("Q4_K", 4, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match="bytes"):
        BlockWeights.of("Q4_K", mx.array(rows[:, :-1]), 256)
    with pytest.raises(ValueError, match="bytes"):
        BlockWeights.of("Q4_K", mx.array(rows), 288)
    bw = BlockWeights.of("Q4_K", mx.array(rows), 256)
    with pytest.raises(ValueError, match="out of range"):
        block_rows_host(np.array([4]), bw)
