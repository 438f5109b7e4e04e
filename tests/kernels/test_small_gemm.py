"""The small-M GEMM in front of the BLAS (engine/cpu/gemm.c): correct against float64 NumPy, and
batch-invariant (a row computed among M rows is bitwise the row computed alone), down to the model:
verifying 5 tokens at once gives bitwise the logits of 5 one-token decode steps."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.blas import blas_info

ACTIVE = blas_info().small_gemm.startswith("rows")
needs_kernel = pytest.mark.skipif(not ACTIVE, reason=f"small-M GEMM not active: {blas_info().small_gemm}")


def _rand(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 20, 25, 32, 100, 256, 257, 600])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (17, 15), (64, 16), (100, 33), (1536, 576), (576, 1536)])
def test_matches_float64_reference(m: int, n: int, k: int) -> None:
    a, w, b = _rand((m, k), 1), _rand((n, k), 2), _rand((k, n), 3)
    ref_nt = np.asarray(a, dtype=np.float64) @ np.asarray(w, dtype=np.float64).T
    ref_nn = np.asarray(a, dtype=np.float64) @ np.asarray(b, dtype=np.float64)
    tol = 1e-5 * np.sqrt(k) * 4
    np.testing.assert_allclose(np.asarray(a @ w.T), ref_nt, rtol=0, atol=tol)  # weights layout
    np.testing.assert_allclose(np.asarray(a @ b), ref_nn, rtol=0, atol=tol)  # scores @ V layout


@needs_kernel
def test_alpha_beta_and_strided_operands() -> None:
    c, a, w = _rand((5, 96), 4), _rand((5, 200), 5), _rand((96, 200), 6)
    out = mx.addmm(c, a, w.T, alpha=0.5, beta=2.0)
    ref = 0.5 * (np.asarray(a, np.float64) @ np.asarray(w, np.float64).T) + 2.0 * np.asarray(c, np.float64)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=1e-4)
    big = _rand((6, 300), 7)
    sub = big[1:6, 10:210]  # a strided view: lda 300 once MLX passes it through
    np.testing.assert_allclose(np.asarray(sub @ w.T),
                               np.asarray(sub, np.float64) @ np.asarray(w, np.float64).T, rtol=0, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("m", [2, 5, 8, 11, 16, 21, 32, 130])
def test_rows_are_bitwise_batch_invariant(m: int) -> None:
    a, w, b = _rand((m, 576), 8), _rand((1536, 576), 9), _rand((576, 208), 10)
    for full, one in ((a @ w.T, lambda i: a[i : i + 1] @ w.T), (a @ b, lambda i: a[i : i + 1] @ b)):
        rows = mx.concatenate([one(i) for i in range(m)])
        assert mx.array_equal(full, rows).item()


@needs_kernel
@pytest.mark.parametrize("m", [257, 300, 512, 777])
def test_rows_beyond_256_are_bitwise_those_computed_alone(m: int) -> None:
    """A step over 256 rows (a prefill chunk beside verification rows) must not leave the kernel: the
    BLAS's GEMM path gives a row other bits than the same row computed alone (it did for every trial)."""
    rng = np.random.default_rng(m)
    for trial in range(6):
        a, w, b = _rand((m, 576), 100 * m + trial), _rand((1536, 576), 11), _rand((576, 208), 12)
        picks = sorted({0, m - 1, *rng.integers(0, m, 6).tolist()})
        full_nt, full_nn = a @ w.T, a @ b
        for i in picks:
            assert mx.array_equal(full_nt[i : i + 1], a[i : i + 1] @ w.T).item(), (m, trial, i)
            assert mx.array_equal(full_nn[i : i + 1], a[i : i + 1] @ b).item(), (m, trial, i)


def test_status_is_reported() -> None:
    status = blas_info().small_gemm
    assert status == "rows: all" or status.startswith("off"), status


@needs_kernel
def test_verification_logits_equal_one_token_decode_bitwise(default_loaded_model) -> None:
    """Five tokens through the model at once (draft verification) vs five one-token steps, across a
    block boundary: every logit bitwise equal. Plain MKL differs in the last bits here."""
    from engine.llm import LLM
    from engine.models import adapter

    llm = LLM(loaded=default_loaded_model, kv_cache_memory="256MiB", max_model_len=512, show_progress=False)
    runner = llm.core.runner
    table = list(range(1, 40))
    ctx = 46  # the 5 tokens cross the 48-token block boundary (block size 16)
    toks = [(i * 7919) % 40000 + 100 for i in range(ctx + 5)]
    mx.eval(runner.forward_chunks([(toks[:ctx], 0, table, 1)]))
    one = []
    for t in range(5):
        h = runner.forward_chunks([(toks[ctx + t : ctx + t + 1], ctx + t, table, 1)])
        one.append(adapter.compute_logits(runner.model, h))
        mx.eval(one[-1])
    five = adapter.compute_logits(runner.model, runner.forward_chunks([(toks[ctx:], ctx, table, 5)]))
    assert mx.array_equal(mx.concatenate(one), five).item()


@needs_kernel
def test_verification_beside_a_long_prefill_chunk_is_bitwise_alone(default_loaded_model) -> None:
    """A step of 305 rows (another request's 300-token prefill chunk beside 5 verification rows), the
    default token budget allows 512: the verification logits are bitwise those of the 5 rows alone."""
    from engine.llm import LLM
    from engine.models import adapter

    llm = LLM(loaded=default_loaded_model, kv_cache_memory="256MiB", max_model_len=512, show_progress=False)
    runner = llm.core.runner
    table, other = list(range(1, 10)), list(range(10, 40))
    ctx = 46
    toks = [(i * 7919) % 40000 + 100 for i in range(ctx + 5)]
    long_chunk = [(i * 104729) % 40000 + 100 for i in range(300)]
    mx.eval(runner.forward_chunks([(toks[:ctx], 0, table, 1)]))
    alone = adapter.compute_logits(runner.model, runner.forward_chunks([(toks[ctx:], ctx, table, 5)]))
    mx.eval(alone)
    mixed = runner.forward_chunks([(long_chunk, 0, other, 0), (toks[ctx:], ctx, table, 5)])
    assert mx.array_equal(adapter.compute_logits(runner.model, mixed), alone).item()


@pytest.mark.parametrize(("given", "expected"), [({}, "1000000"), ({"GOMP_SPINCOUNT": "77"}, "77"),
                                                 ({"OMP_WAIT_POLICY": "passive"}, None)])
def test_openmp_spin_default_is_set_before_libgomp_and_user_values_win(given: dict[str, str],
                                                                       expected: str | None) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import os; from engine import platform; platform.setup(); print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env={**env, **given}, capture_output=True, text=True,
                         check=True).stdout.split()[-1]
    assert out == str(expected)
