"""The low-precision GEMM (engine/cpu/qgemm.c): bf16 / fp16 / affine 8- and 4-bit weights multiplied as
stored. Correct against an independent NumPy dequantize-then-multiply (float64) at every row count
1..256, and batch-invariant (a row among M is bitwise the row alone, threaded or not)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cpu import qgemm
from engine.cpu.qgemm import PackedWeights, qgemm_host, rows_host

WHY = qgemm.unsupported_reason()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"qgemm cannot run here: {WHY}")

_NP16 = {mx.float16: np.float16}


def _host(a: mx.array) -> np.ndarray:
    """float64 copy of any float MLX array (bf16 through float32)."""
    return np.array(a.astype(mx.float32), dtype=np.float64)


def unpack_affine(w: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int) -> np.ndarray:
    """NumPy dequantization of MLX's packed layout (little end of each uint32 first): the reference."""
    words = np.array(w).astype(np.uint64)
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint64) * bits)[None, None, :]
    q = ((words[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(w.shape[0], -1).astype(np.float64)
    s = np.repeat(_host(scales), group, axis=1)
    b = np.repeat(_host(biases), group, axis=1)
    return q * s + b


def make_weights(fmt: str, n: int, k: int, group: int, scale_dtype: mx.Dtype = mx.float16,
                 seed: int = 0) -> tuple[PackedWeights, np.ndarray]:
    w = mx.array(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32))
    if fmt in ("f32", "bf16", "f16"):
        low = w.astype({"f32": mx.float32, "bf16": mx.bfloat16, "f16": mx.float16}[fmt])
        return PackedWeights.floats(low), _host(low)
    bits = int(fmt[1:])
    q, s, b = mx.quantize(w.astype(scale_dtype), group_size=group, bits=bits)
    return PackedWeights.affine(q, s, b, group, bits), unpack_affine(q, s, b, bits, group)


CASES = [("f32", 0, mx.float32), ("bf16", 0, mx.float32), ("f16", 0, mx.float32)] + [
    (f"q{bits}", g, sd) for bits in (8, 4) for g in (32, 64, 128) for sd in (mx.float16, mx.bfloat16)
] + [("q4", 32, mx.float32), ("q8", 64, mx.float32)]


@pytest.mark.parametrize(("fmt", "group", "scale_dtype"), CASES)
def test_matches_dequantize_then_multiply_every_row_count(fmt: str, group: int, scale_dtype: mx.Dtype,
                                                          isa: str) -> None:
    n, k = 43, 256  # 43: ten 4-row blocks (21 2-row blocks past 6 rows) and rows left over
    pw, ref_w = make_weights(fmt, n, k, group, scale_dtype)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((256, k)).astype(np.float32)
    full = a.astype(np.float64) @ ref_w.T
    tol = 4e-7 * np.sqrt(k) * np.abs(ref_w).max() * np.abs(a).max() * 4
    for m in range(1, 257):
        y = qgemm_host(np.ascontiguousarray(a[:m]), pw, isa=isa)
        err = np.abs(y - full[:m]).max()
        assert err <= tol, f"{fmt} group {group} M={m}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "q8", "q4"])
@pytest.mark.parametrize("m", [2, 5, 7, 12, 13, 64, 256])
def test_rows_are_bitwise_batch_invariant(fmt: str, m: int, isa: str) -> None:
    # 1536 x 576: large enough for the threaded path
    pw, _ = make_weights(fmt, 1536, 576, 0 if fmt in ("f32", "bf16", "f16") else 32)
    a = np.random.default_rng(m).standard_normal((m, 576)).astype(np.float32)
    full = qgemm_host(a, pw, isa=isa)
    alone = np.concatenate([qgemm_host(np.ascontiguousarray(a[i : i + 1]), pw, isa=isa) for i in range(m)])
    assert np.array_equal(full, alone)
    one_thread = qgemm_host(a, pw, max_threads=1, isa=isa)
    assert np.array_equal(full, one_thread)


def test_refuses_what_it_cannot_read() -> None:
    w = mx.array(np.ones((8, 40), np.float16))  # K not a multiple of 16
    pw = PackedWeights.floats(w)
    assert not pw.supported()
    with pytest.raises(ValueError, match="refused"):
        qgemm_host(np.ones((1, 40), np.float32), pw)


def test_wrong_layout_is_caught_by_the_reference() -> None:
    """The reference test above can fail: scales read from the wrong group give a different product."""
    pw, ref_w = make_weights("q4", 16, 128, 32)
    s = pw.arrays[1]
    broken = PackedWeights.affine(pw.arrays[0], s[:, ::-1], pw.arrays[2], 32, 4)
    a = np.random.default_rng(3).standard_normal((3, 128)).astype(np.float32)
    assert np.abs(qgemm_host(a, broken) - a.astype(np.float64) @ ref_w.T).max() > 1e-2


def test_no_rows_give_an_empty_product() -> None:
    """A step whose rows are all prefill asks the head for 0 rows of logits."""
    pw, _ = make_weights("q4", 8, 64, 32)
    assert qgemm.qgemm(mx.zeros((0, 64)), pw).shape == (0, 8)


@pytest.mark.parametrize(("fmt", "group", "scale_dtype"), CASES)
def test_embedding_rows_equal_the_dequantized_table(fmt: str, group: int, scale_dtype: mx.Dtype,
                                                    isa: str) -> None:
    """The embedding lookup reads the table the head multiplies by: each row in its natural order."""
    pw, ref_w = make_weights(fmt, 50, 128, group, scale_dtype)
    ids = np.array([0, 49, 7, 7, 31], dtype=np.int32)
    got = rows_host(ids, pw, isa=isa)
    assert got.shape == (5, 128)
    np.testing.assert_allclose(got, ref_w[ids], rtol=2e-7, atol=2e-7 * np.abs(ref_w).max())
    with pytest.raises(ValueError, match="out of range"):
        rows_host(np.array([50], dtype=np.int32), pw)
