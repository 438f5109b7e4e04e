"""metal_kernels/: index math checked everywhere (NumPy emulation), kernels checked on Apple GPUs.

The emulation walks the shaders' launch grids with their index formulas; here it is compared with the
engine's reference attention (MLX gather + attention ops) through the engine's own metadata. The
`metal` tests run the real kernels and skip, with a reason shown in the summary, where MLX has no
Metal device (Linux, CI). On a Mac: `pytest -m metal tests/kernels/test_metal_kernels.py`.
"""

from __future__ import annotations

import logging
import random
import re

import mlx.core as mx
import numpy as np
import pytest

from engine.attention.reference import assemble_groups, paged_attention_reference
from engine.attention.selector import select_attention
from engine.attention.types import AttentionGroup, build_metadata
from engine.kv.cache import PagedKVCache
from metal_kernels import emulate
from metal_kernels.ops import (
    BLOCK_SIZES,
    HEAD_DIMS,
    DecodeLaunch,
    group_rows,
    plan_decode,
    plan_prefill,
    slot_to_token,
)

NO_METAL = not mx.metal.is_available()
needs_metal = pytest.mark.skipif(NO_METAL, reason="no Metal device (mx.metal.is_available() is False): "
                                 "kernel parity runs on Apple Silicon with `pytest -m metal`")


def _scenario(seed: int, bs: int, d: int, lens: list[tuple[int, int]], num_heads: int = 4,
              num_kv_heads: int = 2, dtype: mx.Dtype = mx.float32):
    """lens: per request (context before this step, query tokens this step). Random block tables
    drawn from a shuffled pool, random cache contents, random queries."""
    rng = random.Random(seed)
    need = sum(-(-(c + n) // bs) for c, n in lens)
    num_blocks = need + 5
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    chunks = []
    for c, n in lens:
        nb = -(-(c + n) // bs)
        table, pool = pool[:nb], pool[nb:]
        chunks.append((c, n, table))
    meta = build_metadata(chunks, bs)
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    shape = (num_blocks, bs, num_kv_heads, d)
    kb = mx.random.normal(shape, key=k1).astype(dtype)
    vb = mx.random.normal(shape, key=k2).astype(dtype)
    q = mx.random.normal((meta.num_tokens, num_heads, d), key=k3).astype(dtype)
    return q, kb, vb, meta, chunks


def _emulated_group(softcap: float = 0.0, partition_size: int | None = None):
    def group_fn(q, kb, vb, g: AttentionGroup, scale, window):
        nb, bs, hkv, d = kb.shape
        rows = q if g.identity else q[g.q_index.reshape(-1)]
        seq, ctx = group_rows(g)
        max_ctx = g.block_tables.shape[1] * bs
        launch = plan_decode(rows.shape[0], rows.shape[1], d, bs, max_ctx, partition_size)
        out = emulate.paged_attention_decode(
            np.array(rows.astype(mx.float32)), np.array(kb.reshape(nb * bs, hkv, d).astype(mx.float32)),
            np.array(vb.reshape(nb * bs, hkv, d).astype(mx.float32)), np.array(g.block_tables),
            np.array(seq), np.array(ctx), launch, scale, softcap, window or 0)
        assert not np.isnan(out).any(), "an output element was never written"
        return mx.array(out)
    return group_fn


def _dense_reference(q, kb, vb, chunks, scale, softcap=0.0, window=0):
    """Independent NumPy attention: per query token, gather its keys through the block table."""
    q, kb, vb = (np.array(a.astype(mx.float32)) for a in (q, kb, vb))
    bs, hkv = kb.shape[1], kb.shape[2]
    group = q.shape[1] // hkv
    out, t = np.zeros_like(q), 0
    for c, n, table in chunks:
        for j in range(n):
            pos = c + j
            lo = max(0, pos + 1 - window) if window else 0
            idx = [(table[p // bs], p % bs) for p in range(lo, pos + 1)]
            keys = np.stack([kb[b, o] for b, o in idx])  # [C, Hkv, D]
            vals = np.stack([vb[b, o] for b, o in idx])
            for h in range(q.shape[1]):
                s = keys[:, h // group] @ q[t, h] * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                w = np.exp(s - s.max())
                out[t, h] = (w / w.sum()) @ vals[:, h // group]
            t += 1
    return out


# Decode (1 token), verification (K+1 tokens), contexts ending exactly on and just past block edges.
CASES = [
    [(0, 1)],
    [(7, 1), (8, 1), (9, 1), (30, 1)],
    [(15, 5), (16, 1), (3, 4)],
    [(31, 1), (32, 1), (33, 3), (64, 2), (1, 1)],
]


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_emulated_decode_matches_reference(bs: int, d: int, case: int) -> None:
    q, kb, vb, meta, _ = _scenario(case * 100 + bs + d, bs, d, CASES[case])
    scale = d ** -0.5
    ref = paged_attention_reference(q, kb, vb, meta, scale)
    emu = assemble_groups(q, kb, vb, meta, scale, None, _emulated_group())
    np.testing.assert_allclose(np.array(emu), np.array(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window", [4, 8, 20])
def test_emulated_sliding_window_matches_reference(window: int) -> None:
    q, kb, vb, meta, _ = _scenario(window, 8, 64, [(30, 1), (5, 3), (19, 2)])
    ref = paged_attention_reference(q, kb, vb, meta, 0.125, window)
    emu = assemble_groups(q, kb, vb, meta, 0.125, window, _emulated_group())
    np.testing.assert_allclose(np.array(emu), np.array(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("partition_size", [8, 16, 48])
def test_emulated_split_kv_equals_single_pass(partition_size: int) -> None:
    # Long enough for several partitions, with one row whose context ends inside the first one.
    q, kb, vb, meta, chunks = _scenario(7, 16, 128, [(100, 1), (3, 2), (70, 4)], num_heads=8, num_kv_heads=2)
    scale = 128 ** -0.5
    launch = plan_decode(meta.groups[0].num_rows * meta.groups[0].max_len, 8, 128, 16, 112, partition_size)
    assert launch.split and launch.num_partitions == -(-112 // partition_size)
    split = assemble_groups(q, kb, vb, meta, scale, None, _emulated_group(partition_size=partition_size))
    single = assemble_groups(q, kb, vb, meta, scale, None, _emulated_group())
    np.testing.assert_allclose(np.array(split), np.array(single), rtol=2e-5, atol=2e-5)
    dense = _dense_reference(q, kb, vb, chunks, scale)
    np.testing.assert_allclose(np.array(split), dense, rtol=2e-4, atol=2e-4)


def test_emulated_softcap_matches_dense_reference() -> None:
    q, kb, vb, meta, chunks = _scenario(3, 8, 64, [(12, 1), (40, 3)])
    q = q * 4  # large scores, so the cap changes the result
    scale, cap = 0.125, 5.0
    emu = assemble_groups(q, kb, vb, meta, scale, 6, _emulated_group(softcap=cap, partition_size=16))
    ref = _dense_reference(q, kb, vb, chunks, scale, cap, 6)
    np.testing.assert_allclose(np.array(emu), ref, rtol=2e-4, atol=2e-4)
    uncapped = _dense_reference(q, kb, vb, chunks, scale, 0.0, 6)
    assert np.abs(ref - uncapped).max() > 1e-2  # the case does exercise the cap


def test_plan_decode_splits_long_contexts_only() -> None:
    assert not plan_decode(4, 8, 128, 16, 1024).split
    long = plan_decode(4, 8, 128, 16, 4000)
    assert long.split and long.num_partitions == 8 and long.grid == (32 * 8, 8, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        plan_decode(1, 1, 80, 16, 10)


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_emulated_reshape_and_cache_matches_engine_write(bs: int) -> None:
    cache = PagedKVCache([(2, 64)], 6, bs, mx.float32, head_major=False)  # the kernels' layout
    cache.k[0] = mx.random.normal(cache.k[0].shape)
    cache.v[0] = mx.random.normal(cache.v[0].shape)
    k_old, v_old = np.array(cache.k[0]), np.array(cache.v[0])
    slots = mx.array([0, bs - 1, bs, 3 * bs + 2, 6 * bs - 1], dtype=mx.int32)  # block edges included
    k_new = mx.random.normal((5, 2, 64))
    v_new = mx.random.normal((5, 2, 64))
    inv = np.array(slot_to_token(slots, 6 * bs))
    assert (inv >= 0).sum() == 5 and inv[bs - 1] == 1
    k_emu, v_emu = emulate.reshape_and_cache(np.array(k_new), np.array(v_new), k_old, v_old, inv)
    cache.write(0, slots, k_new, v_new)
    np.testing.assert_array_equal(k_emu, np.array(cache.k[0]))
    np.testing.assert_array_equal(v_emu, np.array(cache.v[0]))


def _by_length(q, kb, vb, g, scale, window):  # noqa: ANN001, ANN202
    # What group_attention_metal does: decode kernel up to 16 query tokens, prefill kernel above.
    fn = _emulated_prefill_group() if g.max_len > 16 else _emulated_group()
    return fn(q, kb, vb, g, scale, window)


@pytest.mark.parametrize("window", [None, 6])
def test_emulated_kernels_read_per_layer_head_sizes(window: int | None) -> None:
    """Gemma4's layout on the engine's block-major cache: one block table, sliding layers of 256 and
    full layers of 512 with fewer KV heads. Each layer's call compiles the shaders for its own HEAD_DIM
    (a template constant); the emulated launches agree with the reference per layer, decode and prefill."""
    shapes = [(2, 256), (1, 512)]
    lens = [(9, 1), (30, 3), (5, 18)]  # decode, verification, a prefill chunk (> 16 tokens)
    q0, kb0, _, meta, _ = _scenario(11, 8, 64, lens)
    num_blocks = kb0.shape[0]
    cache = PagedKVCache(shapes, num_blocks, 8, mx.float32, head_major=False)
    for layer, (hkv, d) in enumerate(shapes):
        key = mx.random.key(layer)
        cache.k[layer] = mx.random.normal(cache.k[layer].shape, key=key)
        cache.v[layer] = mx.random.normal(cache.v[layer].shape, key=mx.random.split(key)[0])
        kb, vb = cache.blocks(layer)
        assert kb.shape == (num_blocks, 8, hkv, d)
        q = mx.random.normal((q0.shape[0], 4, d), key=mx.random.split(key)[1])
        ref = paged_attention_reference(q, kb, vb, meta, d ** -0.5, window)
        emu = assemble_groups(q, kb, vb, meta, d ** -0.5, window, _by_length)
        np.testing.assert_allclose(np.array(emu), np.array(ref), rtol=2e-5, atol=2e-5)
    assert 512 in HEAD_DIMS  # the Metal path takes both sizes (not the gather fallback)


def test_backend_selection_here() -> None:
    from engine.cpu.attention import cpu_paged_attention, unsupported_reason

    fn, label = select_attention("auto")
    if not NO_METAL:
        assert label.startswith("metal")
    elif unsupported_reason() is None:  # x86-64 Linux with AVX-512F: the C kernel
        assert fn is cpu_paged_attention and label.startswith("cpu")
    else:
        assert fn is paged_attention_reference and unsupported_reason() in label
    assert select_attention("reference")[0] is paged_attention_reference
    if NO_METAL:
        with pytest.raises(ValueError, match="needs an Apple GPU"):
            select_attention("metal")
    with pytest.raises(ValueError, match="auto, metal, cpu or reference"):
        select_attention("cuda")  # type: ignore[arg-type]


def _emulated_prefill_group(softcap: float = 0.0, q_tile: int = 8):
    def group_fn(q, kb, vb, g: AttentionGroup, scale, window):
        nb, bs, hkv, d = kb.shape
        rows = q if g.identity else q[g.q_index.reshape(-1)]
        _, ctx = group_rows(g)
        launch = plan_prefill(g.num_rows, g.max_len, rows.shape[1], d, bs, q_tile)
        out = emulate.paged_attention_prefill(
            np.array(rows.astype(mx.float32)), np.array(kb.reshape(nb * bs, hkv, d).astype(mx.float32)),
            np.array(vb.reshape(nb * bs, hkv, d).astype(mx.float32)), np.array(g.block_tables),
            np.array(ctx), launch, scale, softcap, window or 0)
        assert not np.isnan(out).any(), "an output element was never written (or read an unloaded key)"
        return mx.array(out)
    return group_fn


# Prefill chunks (> 16 tokens: their own group): first chunk, chunks continuing a context that ends on
# and just past a block edge, a ragged last query tile (L % 8 != 0).
PREFILL_CASES = [[(0, 17)], [(32, 24), (5, 1)], [(33, 21)], [(7, 40), (2, 3)]]


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_emulated_prefill_matches_reference(bs: int, d: int) -> None:
    case = PREFILL_CASES[(bs + d) % len(PREFILL_CASES)]
    q, kb, vb, meta, _ = _scenario(bs * d, bs, d, case, num_heads=4, num_kv_heads=1)
    assert any(g.max_len > 16 for g in meta.groups)
    scale = d ** -0.5
    ref = paged_attention_reference(q, kb, vb, meta, scale)
    emu = assemble_groups(q, kb, vb, meta, scale, None, _emulated_prefill_group())
    np.testing.assert_allclose(np.array(emu), np.array(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window", [5, 16, 30])
def test_emulated_prefill_sliding_window_and_softcap(window: int) -> None:
    q, kb, vb, meta, chunks = _scenario(window, 8, 64, [(19, 26)])
    ref = paged_attention_reference(q, kb, vb, meta, 0.125, window)
    emu = assemble_groups(q, kb, vb, meta, 0.125, window, _emulated_prefill_group(q_tile=4))
    np.testing.assert_allclose(np.array(emu), np.array(ref), rtol=2e-5, atol=2e-5)
    q = q * 4
    capped = assemble_groups(q, kb, vb, meta, 0.125, window, _emulated_prefill_group(softcap=5.0))
    dense = _dense_reference(q, kb, vb, chunks, 0.125, 5.0, window)
    np.testing.assert_allclose(np.array(capped), dense, rtol=2e-4, atol=2e-4)
    assert np.abs(dense - _dense_reference(q, kb, vb, chunks, 0.125, 0.0, window)).max() > 1e-2


@pytest.mark.parametrize("window", [None, 7])
def test_reference_mixed_step_groups_and_matches_dense(window: int | None) -> None:
    """A step mixing decode rows, verification rows of different lengths and a long prefill chunk:
    short rows are grouped by length (nobody is padded to a longer request's length), each long chunk
    is alone; the output is in batch order either way."""
    lens = [(9, 1), (20, 3), (40, 1), (5, 25), (16, 5), (1, 1), (30, 3)]
    q, kb, vb, meta, chunks = _scenario(31, 8, 64, lens)
    shapes = [(g.num_rows, g.max_len, g.identity) for g in meta.groups]
    assert shapes == [(3, 1, False), (2, 3, False), (1, 5, False), (1, 25, False)]
    out = np.array(paged_attention_reference(q, kb, vb, meta, 0.125, window))
    np.testing.assert_allclose(out, _dense_reference(q, kb, vb, chunks, 0.125, 0.0, window or 0),
                               rtol=2e-5, atol=2e-5)
    decode_only = build_metadata([(9, 1, chunks[0][2]), (40, 1, chunks[2][2])], 8)
    assert [(g.num_rows, g.max_len, g.identity) for g in decode_only.groups] == [(2, 1, True)]


@pytest.mark.parametrize("window", [None, 7])
def test_head_major_cache_gives_the_block_major_output(window: int | None) -> None:
    """The CPU's head-major cache ([Hkv, slots, D]) attends as the block-major one: same step mix (decode
    rows, verification rows, a long chunk), a pure-decode step and a single request, to float32 rounding
    (the head-major path's softmax exponentiates by powers of two); and a cache write lands the same
    values in either layout."""
    lens = [(9, 1), (20, 3), (40, 1), (5, 25), (16, 5), (1, 1), (30, 3)]
    q, kb, vb, meta, chunks = _scenario(31, 8, 64, lens, num_heads=6, num_kv_heads=2)
    nb, bs, hkv, d = kb.shape

    def head_major(a: mx.array) -> mx.array:
        return mx.contiguous(a.reshape(nb * bs, hkv, d).transpose(1, 0, 2))

    kh, vh = head_major(kb), head_major(vb)
    decode = build_metadata([(9, 1, chunks[0][2]), (40, 1, chunks[2][2])], bs)
    single = build_metadata([chunks[3]], bs)
    for m in (meta, decode, single):
        qm = q[: m.num_tokens]
        want = paged_attention_reference(qm, kb, vb, m, 0.125, window)
        got = paged_attention_reference(qm, kh, vh, m, 0.125, window)
        assert got.shape == want.shape
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    caches = [PagedKVCache([(2, 64)], 4, 16, mx.float32, head_major=h) for h in (False, True)]
    slots = mx.array([0, 15, 16, 63], dtype=mx.int32)
    k_new, v_new = mx.random.normal((4, 2, 64)), mx.random.normal((4, 2, 64))
    for c in caches:
        c.write(0, slots, k_new, v_new)
    (kb0, vb0), (kh0, vh0) = caches[0].blocks(0), caches[1].blocks(0)
    assert kh0.shape == (2, 64, 64) and mx.array_equal(kh0, kb0.reshape(64, 2, 64).transpose(1, 0, 2)).item()
    assert mx.array_equal(vh0, vb0.reshape(64, 2, 64).transpose(1, 0, 2)).item()
    assert mx.array_equal(vh0[:, slots], v_new.transpose(1, 0, 2)).item()


def test_emulated_prefill_several_sequences_per_launch() -> None:
    # The kernel takes S sequences of L rows each (sequence-major); the engine sends one, check more.
    bs, d, L = 16, 64, 19
    q, kb, vb, _, chunks = _scenario(11, bs, d, [(3, L), (40, L)])
    nb = max(len(t) for _, _, t in chunks)
    tables = np.array([t + [0] * (nb - len(t)) for _, _, t in chunks], np.int32)
    ctx = np.array([c + j + 1 for c, n, _ in chunks for j in range(n)], np.int32)
    launch = plan_prefill(2, L, 4, d, bs)
    assert launch.grid == (32 * 4, 8, 2 * 3) and launch.kv_tile == 32
    kf, vf = np.array(kb.reshape(-1, 2, d)), np.array(vb.reshape(-1, 2, d))
    out = emulate.paged_attention_prefill(np.array(q), kf, vf, tables, ctx, launch, d ** -0.5)
    np.testing.assert_allclose(out, _dense_reference(q, kb, vb, chunks, d ** -0.5), rtol=2e-4, atol=2e-4)


class _EmulatedKernel:
    """Stands in for an `mx.fast.metal_kernel` object: takes the wrapper's exact launch arguments
    (inputs, template, grid, threadgroup, output shapes) and runs the emulation with them."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None):
        t = dict(template)
        a = [np.array(x.astype(mx.float32)) if x.dtype in (mx.float16, mx.bfloat16) else np.array(x)
             for x in inputs]
        assert all(g % tg == 0 for g, tg in zip(grid, threadgroup, strict=True)), (grid, threadgroup)
        assert threadgroup[0] * threadgroup[1] * threadgroup[2] <= 1024
        if self.name == "prefill":
            q, kc, vc, tables, ctx, params = a
            assert threadgroup == (32, t["Q_TILE"], 1) and 8 * t["KV_TILE"] * t["HEAD_DIM"] <= 32768
            launch = plan_prefill(tables.shape[0], int(params[3]), grid[0] // 32, t["HEAD_DIM"],
                                  t["BLOCK_SIZE"], t["Q_TILE"])
            assert launch.grid == tuple(grid) and launch.kv_tile == t["KV_TILE"]
            assert launch.tiles_per_seq == params[4]
            outs = [emulate.paged_attention_prefill(q, kc, vc, tables, ctx, launch, float(params[0]),
                                                    float(params[1]), int(params[2]))]
        elif self.name == "reduce":
            acc, mmax, msum = a
            R, H, P = mmax.shape
            launch = DecodeLaunch(R, H, t["HEAD_DIM"], 0, 0, P)
            assert launch.reduce_grid == tuple(grid) and launch.reduce_threadgroup == tuple(threadgroup)
            outs = [emulate.paged_attention_reduce(acc.reshape(-1), mmax.reshape(-1), msum.reshape(-1),
                                                   launch)]
        elif self.name == "cache":
            key, value, kc, vc, inv = a
            outs = list(emulate.reshape_and_cache(key, value, kc, vc, inv))
        else:  # decode_direct / decode_split
            q, kc, vc, tables, seq, ctx, params = a
            launch = DecodeLaunch(grid[2], grid[1], t["HEAD_DIM"], t["BLOCK_SIZE"], t["PARTITION_SIZE"],
                                  grid[0] // 32)
            assert int(params[3]) == launch.num_partitions and threadgroup == launch.threadgroup
            assert launch.split == (self.name == "decode_split")
            res = emulate.paged_attention_decode(q, kc, vc, tables, seq, ctx, launch, float(params[0]),
                                                 float(params[1]), int(params[2]), partials=True)
            outs = list(res) if isinstance(res, tuple) else [res]
        assert len(outs) == len(output_shapes)
        shapes = zip(outs, output_shapes, output_dtypes, strict=True)
        return [mx.array(o.reshape(shape)).astype(dt) for o, shape, dt in shapes]


@pytest.mark.parametrize("window", [None, 12])
def test_metal_dispatch_with_emulated_kernels_matches_reference(monkeypatch: pytest.MonkeyPatch,
                                                                window: int | None) -> None:
    """The Metal backend's Python side (grouping, routing by chunk length, launch planning, params)
    end to end, with each kernel replaced by its emulation: a mixed step with decode rows,
    verification rows, a prefill chunk for the prefill kernel, one for the gather path, and a
    context long enough for the split-KV variant."""
    from metal_kernels import ops

    calls: list[str] = []

    def fake_kernels() -> dict[str, object]:
        def make(name: str) -> object:
            k = _EmulatedKernel(name)
            return lambda **kw: (calls.append(name), k(**kw))[1]
        return {n: make(n) for n in ("decode_direct", "decode_split", "reduce", "prefill")}

    monkeypatch.setattr(ops, "_kernels", fake_kernels)
    lens = [(5, 1), (16, 4), (0, 40), (3, 150)]
    q, kb, vb, meta, _ = _scenario(21, 16, 64, lens, num_heads=4, num_kv_heads=2)
    ref = paged_attention_reference(q, kb, vb, meta, 0.125, window)
    out = ops.paged_attention_metal(q, kb, vb, meta, 0.125, window)
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=2e-5, atol=2e-5)
    # decode rows and verification rows are separate groups; the 150-token chunk took the gather path
    assert calls == ["decode_direct", "decode_direct", "prefill"]
    calls.clear()
    q, kb, vb, meta, _ = _scenario(22, 8, 64, [(1100, 1), (40, 3)])  # > SPLIT_THRESHOLD keys: split
    ref = paged_attention_reference(q, kb, vb, meta, 0.125, window)
    out = ops.paged_attention_metal(q, kb, vb, meta, 0.125, window)
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=2e-5, atol=2e-5)
    assert calls == ["decode_split", "reduce", "decode_direct"]  # the short verification group: direct


KERNEL_NAMES = ("decode_direct", "decode_split", "reduce", "prefill", "cache")


def _emulated_kernels(**replace: object) -> dict[str, object]:
    return {n: replace.get(n, _EmulatedKernel(n)) for n in KERNEL_NAMES}


def _fails_to_compile(**kw: object) -> list[mx.array]:
    raise RuntimeError("[metal::Device] Unable to build metal library from source: error: use of "
                       "undeclared identifier 'simd_sum'")


def _off_by_a_little(name: str) -> object:
    """The emulated kernel with every output shifted: runs, but disagrees with the reference path."""
    k = _EmulatedKernel(name)
    return lambda **kw: [o + 0.5 for o in k(**kw)]


def test_self_test_passes_kernels_that_compute_the_reference() -> None:
    """The start-up self-test with the NumPy emulation standing in for the compiled kernels (what a
    correct GPU computes): every kernel passes, and `auto` on a Metal machine picks the kernels."""
    from metal_kernels import ops

    assert ops.self_test(_emulated_kernels()) == []
    fn, label = select_attention("auto", metal_available=True, metal_kernels=_emulated_kernels())
    assert fn is ops.paged_attention_metal and label.startswith("metal")


# (kernel replaced, how it fails, the self-test check that must name it)
BROKEN = [("prefill", "compile error", "prefill"), ("decode_direct", "compile error", "decode"),
          ("decode_direct", "mismatch", "decode"), ("decode_split", "mismatch", "decode_split + reduce"),
          ("reduce", "mismatch", "decode_split + reduce"), ("prefill", "mismatch", "prefill"),
          ("cache", "mismatch", "reshape_and_cache")]


@pytest.mark.parametrize(("kernel", "how", "check"), BROKEN)
def test_broken_kernel_falls_back_or_refuses(kernel: str, how: str, check: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """Untested hardware fails safe: a kernel that does not compile or disagrees with the reference path
    is named in the log and `auto` takes the reference path; `--attention-backend metal` refuses."""
    from metal_kernels import ops

    broken = _fails_to_compile if how == "compile error" else _off_by_a_little(kernel)
    kernels = _emulated_kernels(**{kernel: broken})
    failures = ops.self_test(kernels, dtypes=(mx.float32,))
    assert failures and all(f.startswith(f"{check} (") for f in failures), failures
    assert ("Unable to build metal library" if how == "compile error" else "from the reference path") \
        in failures[0]
    with caplog.at_level(logging.WARNING, logger="engine.attention.selector"):
        fn, label = select_attention("auto", metal_available=True, metal_kernels=kernels)
    assert fn is paged_attention_reference and label.startswith("reference") and f"{check} (" in label
    assert any("self-test" in r.getMessage() and f"{check} (" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"--attention-backend metal: .*self-test: " + re.escape(check)):
        select_attention("metal", metal_available=True, metal_kernels=kernels)


# -- the real kernels (Apple GPUs) --------------------------------------------------------------------
TOL = {mx.float32: 2e-4, mx.float16: 2e-2, mx.bfloat16: 5e-2}


@pytest.fixture
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel outputs start as NaN (MLX's init_value), so an element a kernel never writes fails."""
    from metal_kernels import ops

    monkeypatch.setattr(ops, "OUTPUT_INIT", float("nan"))


def _metal_matches_reference(cases: list, seed: int, bs: int, d: int, dtype: mx.Dtype,
                             window: int | None) -> None:
    from metal_kernels.ops import paged_attention_metal

    for case in cases:
        q, kb, vb, meta, _ = _scenario(seed, bs, d, case, dtype=dtype)
        ref = paged_attention_reference(q, kb, vb, meta, d ** -0.5, window)
        out = paged_attention_metal(q, kb, vb, meta, d ** -0.5, window)
        np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                                   rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.metal
@needs_metal
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("window", [None, 9])
def test_metal_decode_matches_reference(dtype: mx.Dtype, bs: int, d: int, window: int | None) -> None:
    _metal_matches_reference(CASES, bs + d, bs, d, dtype, window)


@pytest.mark.metal
@needs_metal
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("partition_size", [16, 48])
def test_metal_split_and_softcap_match_dense(partition_size: int) -> None:
    from metal_kernels.ops import paged_attention_decode

    q, kb, vb, meta, chunks = _scenario(5, 16, 128, [(100, 1), (3, 2), (70, 4)], num_heads=8)
    g = meta.groups[0]
    seq, ctx = group_rows(g)
    nb, bs, hkv, d = kb.shape
    rows = q[g.q_index.reshape(-1)]
    out = paged_attention_decode(rows, kb.reshape(nb * bs, hkv, d), vb.reshape(nb * bs, hkv, d),
                                 g.block_tables, seq, ctx, bs, d ** -0.5, softcap=5.0,
                                 partition_size=partition_size)
    got = np.array(out)[np.array(meta.out_index)]
    np.testing.assert_allclose(got, _dense_reference(q, kb, vb, chunks, d ** -0.5, 5.0), rtol=2e-4, atol=2e-4)


@pytest.mark.metal
@needs_metal
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("window", [None, 13])
def test_metal_prefill_matches_reference(dtype: mx.Dtype, bs: int, d: int, window: int | None) -> None:
    _metal_matches_reference(PREFILL_CASES, bs * d, bs, d, dtype, window)


@pytest.mark.metal
@needs_metal
@pytest.mark.usefixtures("poison_outputs")
def test_metal_prefill_softcap_matches_dense() -> None:
    from metal_kernels.ops import paged_attention_prefill

    q, kb, vb, meta, chunks = _scenario(9, 16, 128, [(40, 30)])
    q = q * 4
    nb, bs, hkv, d = kb.shape
    g = meta.groups[0]
    _, ctx = group_rows(g)
    out = paged_attention_prefill(q, kb.reshape(nb * bs, hkv, d), vb.reshape(nb * bs, hkv, d), g.block_tables,
                                  ctx, bs, d ** -0.5, softcap=5.0, window=20)
    np.testing.assert_allclose(np.array(out), _dense_reference(q, kb, vb, chunks, d ** -0.5, 5.0, 20),
                               rtol=2e-4, atol=2e-4)


@pytest.mark.metal
@needs_metal
@pytest.mark.usefixtures("poison_outputs")
def test_metal_reshape_and_cache_matches_engine_write() -> None:
    from metal_kernels.ops import reshape_and_cache

    cache = PagedKVCache([(2, 64)], 4, 16, mx.float16, head_major=False)
    slots = mx.array([0, 15, 16, 63], dtype=mx.int32)
    k_new, v_new = mx.random.normal((4, 2, 64)), mx.random.normal((4, 2, 64))
    k_out, v_out = reshape_and_cache(k_new, v_new, cache.k[0], cache.v[0], slots)
    cache.write(0, slots, k_new, v_new)
    assert mx.array_equal(k_out, cache.k[0]).item() and mx.array_equal(v_out, cache.v[0]).item()


@pytest.mark.skipif(not NO_METAL, reason="this machine has Metal: the forced backend is valid here")
def test_engine_refuses_forced_metal_backend_without_metal(caplog: pytest.LogCaptureFixture) -> None:
    from tests.helpers import make_llm

    with pytest.raises(ValueError, match="--attention-backend metal needs an Apple GPU"):
        make_llm(attention_backend="metal")
    with caplog.at_level(logging.INFO, logger="engine.core"):
        llm = make_llm(attention_backend="reference")  # forcing the reference path works everywhere
    assert llm.core.runner.caches[0].attention_fn is paged_attention_reference
    assert any(r.getMessage().startswith("attention backend: reference") for r in caplog.records)


@pytest.mark.skipif(not NO_METAL, reason="this machine has Metal: the forced backend is valid here")
def test_server_refuses_forced_metal_backend_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    from server.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--attention-backend", "metal", "--port", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "attention_backend" in err and "--attention-backend metal needs an Apple GPU" in err


def test_cli_flag_reaches_the_engine_config() -> None:
    from server.cli import build_parser
    from server.cli.serve import resolve_settings

    settings = resolve_settings(build_parser().parse_args(["serve", "--attention-backend", "reference"]), {})
    assert settings.engine_config_kwargs()["attention_backend"] == "reference"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "cuda"])
