"""The reference paged attention in plain MLX ops (gather a group's KV blocks, then attend): the fallback
wherever no kernel runs, and the kernels' self-test yardstick."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.attention.types import AttentionGroup, AttentionMetadata, build_metadata

LOG2E = 1.4426950408889634


def group_attention_reference(
    q: mx.array,  # [T, H, D]
    k_blocks: mx.array,  # [num_blocks, block_size, Hkv, D], or head-major [Hkv, slots, D]
    v_blocks: mx.array,
    g: AttentionGroup,
    scale: float,
    window: int | None = None,
) -> mx.array:  # [R * L, H, D]
    """One group: gather its blocks into contiguous keys/values and run MLX's fused attention."""
    if k_blocks.ndim == 3:
        return _group_attention_head_major(q, k_blocks, v_blocks, g, scale, window)
    _, bs, hkv, d = k_blocks.shape
    R, L = g.num_rows, g.max_len
    ctx = g.block_tables.shape[1] * bs
    if g.identity:
        qg = q[:, :, None, :] if L == 1 else q.transpose(1, 0, 2)[None]  # [R, H, L, D]
    else:
        qg = mx.contiguous(q[g.q_index].transpose(0, 2, 1, 3))
    # [R, Hkv, C, D] copies: MLX's CPU SDPA on transposed views was far slower.
    kg = mx.contiguous(k_blocks[g.block_tables].reshape(R, ctx, hkv, d).transpose(0, 2, 1, 3))
    vg = mx.contiguous(v_blocks[g.block_tables].reshape(R, ctx, hkv, d).transpose(0, 2, 1, 3))
    o = mx.fast.scaled_dot_product_attention(qg, kg, vg, scale=scale, mask=g.mask(window))
    return o.transpose(0, 2, 1, 3).reshape(R * L, q.shape[1], d)


def _group_attention_head_major(q: mx.array, k: mx.array, v: mx.array, g: AttentionGroup, scale: float,
                                window: int | None) -> mx.array:
    """`group_attention_reference` on a head-major cache ([Hkv, slots, D]): KV heads are the batch, each one's
    G = H / Hkv query heads folded into the query length."""
    hkv, slots, d = k.shape
    R, L = g.num_rows, g.max_len
    h = q.shape[1]
    G = h // hkv
    bs = g.block_size
    ctx = g.block_tables.shape[1] * bs
    # Whole blocks per (head, request): a gather of single slots showed in the decode step's time.
    rows = g.head_block_rows(hkv, slots // bs)
    kg = k.reshape(-1, bs * d)[rows].reshape(hkv, R, ctx, d)
    vg = v.reshape(-1, bs * d)[rows].reshape(hkv, R, ctx, d)
    qr = q.reshape(R, L, h, d) if g.identity else q[g.q_index]  # [R, L, H, D]
    # [R, L, Hkv, G, D] -> [Hkv, R, G, L, D] -> [Hkv, R, G * L, D]
    qh = qr.reshape(R, L, hkv, G, d).transpose(2, 0, 3, 1, 4).reshape(hkv, R, G * L, d)
    o = _attend_pow2(qh, kg, vg, scale, g.folded_mask(window, G))
    # [Hkv, R, G, L, D] -> [R, L, Hkv, G, D] -> [R * L, H, D]
    return o.reshape(hkv, R, G, L, d).transpose(1, 3, 0, 2, 4).reshape(R * L, h, d)


def _attend_pow2(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    """softmax(q k^T * scale, masked) v, the exponential a power of two (cheaper on MLX's CPU)."""
    s = (q * (scale * LOG2E)) @ k.swapaxes(-1, -2)
    s = mx.where(mask, s, -mx.inf)  # every query sees at least its own key: no row is all -inf
    p = mx.power(2.0, s - s.max(axis=-1, keepdims=True))
    return (p @ v) / p.sum(axis=-1, keepdims=True)


GroupAttention = Callable[[mx.array, mx.array, mx.array, AttentionGroup, float, "int | None"], mx.array]


def assemble_groups(q: mx.array, k_blocks: mx.array, v_blocks: mx.array, meta: AttentionMetadata,
                    scale: float, window: int | None, group_fn: GroupAttention) -> mx.array:
    """Run each group and put the rows back in batch order ([T, H, D])."""
    outs = [group_fn(q, k_blocks, v_blocks, g, scale, window) for g in meta.groups]
    if len(outs) == 1 and meta.groups[0].identity:
        return outs[0]
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out[meta.out_index]


def paged_attention_reference(
    q: mx.array,  # [T, H, D]
    k_blocks: mx.array,  # [num_blocks, block_size, Hkv, D], or head-major [Hkv, slots, D]
    v_blocks: mx.array,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> mx.array:  # [T, H, D]
    return assemble_groups(q, k_blocks, v_blocks, meta, scale, window, group_attention_reference)


def random_case(lens: list[tuple[int, int]], block_size: int, head_dim: int, num_heads: int,
                num_kv_heads: int, head_major: bool, dtype: mx.Dtype = mx.float32, seed: int = 0
                ) -> tuple[mx.array, mx.array, mx.array, AttentionMetadata]:
    """A random step over a random paged cache for kernel self-tests: `lens` per request (context before the
    step, tokens this step). Blocks are numbered backwards, so a kernel ignoring the block table fails.
    -> q [T, H, D], key and value caches, metadata."""
    chunks, first = [], 1  # block 0 stays unused
    for start, n in lens:
        nb = -(-(start + n) // block_size)
        chunks.append((start, n, list(range(first + nb - 1, first - 1, -1))))
        first += nb
    meta = build_metadata(chunks, block_size)
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    shape = (num_kv_heads, first * block_size, head_dim) if head_major else \
        (first, block_size, num_kv_heads, head_dim)
    k = mx.random.normal(shape, key=k1).astype(dtype)
    v = mx.random.normal(shape, key=k2).astype(dtype)
    q = mx.random.normal((meta.num_tokens, num_heads, head_dim), key=k3).astype(dtype)
    return q, k, v, meta


def reference_mismatch(got: mx.array, want: mx.array, tol: float) -> str | None:
    """Why a kernel's output disagrees with the reference path's (None: within `tol`, abs. and rel.)."""
    if tuple(got.shape) != tuple(want.shape):
        return f"output shape {tuple(got.shape)}, the reference path's {tuple(want.shape)}"
    g = np.array(got.astype(mx.float32))
    w = np.array(want.astype(mx.float32))
    if not np.isfinite(g).all():
        return "non-finite outputs"
    err = np.abs(g - w) - tol * np.abs(w)
    if err.max(initial=0.0) > tol:
        return f"max |difference| {np.abs(g - w).max():.3g} from the reference path (tolerance {tol:g})"
    return None
