"""Paged KV storage and the reference (plain MLX) paged attention used wherever no kernel exists.

Two layouts per layer, both flat over slots (block * block_size + offset) so that slot writes update the
array in place (MLX donates a buffer whose only owner is the scatter):
- block-major `[num_blocks * block_size, num_kv_heads, head_dim]` (a free reshape of `[num_blocks,
  block_size, num_kv_heads, head_dim]`): what the Metal kernels read;
- head-major `[num_kv_heads, num_blocks * block_size, head_dim]`, the default on the CPU: gathering a
  group's blocks head by head lands directly in the layout attention takes, where the block-major gather
  needs a second, transposing copy. At 32 decode rows x 400 keys, 30 layers, 2-core CPU: 209 against
  408 ms (then both through MLX's SDPA, bitwise the same output). The head-major path also takes the
  softmax's exponential as a power of two (`_attend_pow2`), cheaper on MLX's CPU backend.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx
import numpy as np

logger = logging.getLogger(__name__)

# Requests computing more than this many tokens in a step get their own attention call; shorter ones
# share one per query length.
_PAD_GROUP_MAX_TOKENS = 16
LOG2E = 1.4426950408889634


def head_major_default() -> bool:
    """The head-major layout where it was measured to pay (the CPU); the Metal kernels read block-major,
    and a CUDA device keeps the layout its numbers were taken with. `SPECSERVE_KV_LAYOUT=block|head`
    forces one (head with the Metal backend is refused: its kernels read block-major)."""
    forced = os.environ.get("SPECSERVE_KV_LAYOUT", "auto").strip().lower()
    if forced in ("block", "head"):
        return forced == "head"
    return not mx.metal.is_available() and mx.default_device() == mx.cpu


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: mx.Dtype, head_major: bool | None = None) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.head_major = head_major_default() if head_major is None else head_major
        slots = num_blocks * block_size
        shape = (num_kv_heads, slots, head_dim) if self.head_major else (slots, num_kv_heads, head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.k, self.v)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: mx.Dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        # slots: [T], k/v: [T, num_kv_heads, head_dim]
        if self.head_major:
            self.k[layer][:, slots] = k.transpose(1, 0, 2).astype(self.dtype)
            self.v[layer][:, slots] = v.transpose(1, 0, 2).astype(self.dtype)
        else:
            self.k[layer][slots] = k.astype(self.dtype)
            self.v[layer][slots] = v.astype(self.dtype)

    def blocks(self, layer: int) -> tuple[mx.array, mx.array]:
        """What attention reads: head-major `[Hkv, slots, D]` as stored, or block-major
        `[num_blocks, block_size, Hkv, D]` (attention tells them apart by their number of axes)."""
        if self.head_major:
            return self.k[layer], self.v[layer]
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return self.k[layer].reshape(shape), self.v[layer].reshape(shape)


@dataclass(slots=True)
class AttentionGroup:
    """Requests of one query length attended in one call: queries [R, L], keys gathered from their blocks."""

    q_index: mx.array  # [R, L] int32 rows of the flat token batch
    q_pos: mx.array  # [R, L] int32 absolute positions
    block_tables: mx.array  # [R, NB] int32 (shorter tables padded with block 0, masked out)
    num_rows: int
    max_len: int
    block_size: int
    # The group is the whole batch in order (pure decode: L == 1, or a single request: R == 1):
    # queries and outputs are reshapes, not gathers.
    identity: bool = False
    _masks: dict[int | None, mx.array] = field(default_factory=dict)
    _folded: dict[tuple[int | None, int], mx.array] = field(default_factory=dict)
    _rows: dict[tuple[int, int], mx.array] = field(default_factory=dict)

    def folded_mask(self, window: int | None, heads_per_kv: int) -> mx.array:
        # [1, R, G * L, C]: `mask` with each KV head's G query heads folded into the query length.
        key = (window, heads_per_kv)
        m = self._folded.get(key)
        if m is None:
            base = self.mask(window)
            r, _, L, c = base.shape
            m = mx.broadcast_to(base, (r, heads_per_kv, L, c)).reshape(1, r, heads_per_kv * L, c)
            self._folded[key] = m
        return m

    def head_block_rows(self, num_kv_heads: int, num_blocks: int) -> mx.array:
        # [Hkv * R * NB] int32: rows of a head-major cache viewed as [Hkv * num_blocks, block_size * D],
        # head by head, then request by request, then block by block (the head-major gather's index).
        key = (num_kv_heads, num_blocks)
        rows = self._rows.get(key)
        if rows is None:
            heads = mx.arange(num_kv_heads, dtype=mx.int32)[:, None, None] * num_blocks
            rows = self._rows[key] = (heads + self.block_tables[None]).reshape(-1)
        return rows

    def mask(self, window: int | None) -> mx.array:
        # [R, 1, L, NB * block_size] bool: causal (key <= query) and inside the sliding window.
        m = self._masks.get(window)
        if m is None:
            kpos = mx.arange(self.block_tables.shape[1] * self.block_size, dtype=mx.int32)
            qpos = self.q_pos[:, None, :, None]
            m = kpos[None, None, None, :] <= qpos
            if window is not None:
                m = m & (kpos[None, None, None, :] > qpos - window)
            self._masks[window] = m
        return m


@dataclass(slots=True)
class HostMetadata:
    """The step's layout as NumPy int32 arrays, for attention written in C (engine/cpu_attention.py)."""

    positions: np.ndarray  # [T] each token's position
    token_table: np.ndarray  # [T] offset of its request's block table in `tables`
    tables: np.ndarray  # the requests' block tables, concatenated
    block_size: int
    max_context: int  # the longest request's context this step (keys attended by its last token)


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once by the runner and shared by layers."""

    positions: mx.array  # [T] int32
    slot_mapping: mx.array  # [T] int32
    groups: list[AttentionGroup]
    out_index: mx.array  # [T] rows of the concatenated group outputs, back in batch order
    num_tokens: int
    start_pos: int  # position of the first token (what RoPE needs when there is a single request)
    chunks: list[tuple[int, int, list[int]]] = field(default_factory=list)  # build_metadata's input
    block_size: int = 0
    _host: HostMetadata | None = None

    def host(self) -> HostMetadata:
        """Built on first use and shared by the step's layers."""
        if self._host is None:
            positions: list[int] = []
            token_table: list[int] = []
            tables: list[int] = []
            for start, n, table in self.chunks:
                positions.extend(range(start, start + n))
                token_table.extend([len(tables)] * n)
                tables.extend(table)
            self._host = HostMetadata(
                positions=np.array(positions, dtype=np.int32),
                token_table=np.array(token_table, dtype=np.int32),
                tables=np.array(tables or [0], dtype=np.int32), block_size=self.block_size,
                max_context=max((s + n for s, n, _ in self.chunks if n), default=1))
        return self._host

    @property
    def single_request(self) -> bool:
        """One request this step: the model can run in its usual [1, T, hidden] layout."""
        return len(self.groups) == 1 and self.groups[0].num_rows == 1


def build_metadata(
    chunks: list[tuple[int, int, list[int]]], block_size: int
) -> AttentionMetadata:
    """chunks: per request (start_pos, num_tokens, block_table), in batch order."""
    positions: list[int] = []
    slots: list[int] = []
    for start, n, table in chunks:
        for p in range(start, start + n):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)

    # One group per query length up to _PAD_GROUP_MAX_TOKENS, so no query row is padded: decode rows are
    # not padded to a verifying request's length, nor is a request verifying one draft padded to
    # another's four (adaptive K mixes lengths every step: at 32 requests, 31 x 2 tokens + 1 x 5 took
    # 889 ms padded to 5 against 706 ms for 32 x 2, on this CPU; the cost model assumes a step's cost
    # grows with its tokens). Each long chunk is a group of its own.
    short: dict[int, list[int]] = {}
    large: list[list[int]] = []
    offsets = [0]
    for i, (_, n, _) in enumerate(chunks):
        offsets.append(offsets[-1] + n)
        if n > _PAD_GROUP_MAX_TOKENS:
            large.append([i])
        elif n > 0:
            short.setdefault(n, []).append(i)

    groups: list[AttentionGroup] = []
    out_index = [0] * len(positions)
    base = 0
    for members in [short[n] for n in sorted(short)] + large:
        L = chunks[members[0]][1]  # every member computes L tokens
        NB = max(-(-(chunks[i][0] + L) // block_size) for i in members)
        q_index, q_pos, tables = [], [], []
        for r, i in enumerate(members):
            start, _, table = chunks[i]
            for j in range(L):
                out_index[offsets[i] + j] = base + r * L + j
            q_index.append(list(range(offsets[i], offsets[i] + L)))
            q_pos.append(list(range(start, start + L)))
            tables.append(list(table[:NB]) + [0] * (NB - min(NB, len(table))))
        groups.append(AttentionGroup(
            q_index=mx.array(q_index, dtype=mx.int32), q_pos=mx.array(q_pos, dtype=mx.int32),
            block_tables=mx.array(tables, dtype=mx.int32), num_rows=len(members), max_len=L,
            block_size=block_size,
            identity=len(members) == len(chunks) and (L == 1 or len(members) == 1)))
        base += len(members) * L
    return AttentionMetadata(
        positions=mx.array(positions, dtype=mx.int32), slot_mapping=mx.array(slots, dtype=mx.int32),
        groups=groups, out_index=mx.array(out_index, dtype=mx.int32), num_tokens=len(positions),
        start_pos=chunks[0][0] if chunks else 0, chunks=chunks, block_size=block_size)


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
    # Contiguous copies: MLX's CPU SDPA on the transposed views was ~10x slower than copy + SDPA
    # (46 vs 9 ms per layer at 32 decode rows x 300 keys, AVX2). kg, vg: [R, Hkv, C, D].
    kg = mx.contiguous(k_blocks[g.block_tables].reshape(R, ctx, hkv, d).transpose(0, 2, 1, 3))
    vg = mx.contiguous(v_blocks[g.block_tables].reshape(R, ctx, hkv, d).transpose(0, 2, 1, 3))
    o = mx.fast.scaled_dot_product_attention(qg, kg, vg, scale=scale, mask=g.mask(window))
    return o.transpose(0, 2, 1, 3).reshape(R * L, q.shape[1], d)


def _group_attention_head_major(q: mx.array, k: mx.array, v: mx.array, g: AttentionGroup, scale: float,
                                window: int | None) -> mx.array:
    """`group_attention_reference` on a head-major cache ([Hkv, slots, D]). The gather of the group's
    blocks gives [Hkv, R * C, D], a free reshape of [Hkv, R, C, D]: attention then runs with the KV heads
    as its batch and the group's requests as its heads, each query head's G = H / Hkv rows folded into the
    query length of its KV head. Per (request, head) the same dot products and sums as the block-major
    path; only the exponential differs (`_attend_pow2`)."""
    hkv, slots, d = k.shape
    R, L = g.num_rows, g.max_len
    h = q.shape[1]
    G = h // hkv
    bs = g.block_size
    ctx = g.block_tables.shape[1] * bs
    # Whole blocks per (head, request): each index copies bs * D contiguous values, where a gather of
    # single slots copied D at a time (30 layers, one request, ~300 keys: 2% of a decode step; 8
    # requests: 5.5%). Same values, bitwise.
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
    """softmax(q k^T * scale, masked) v, as MLX's CPU SDPA composes it, with the exponential taken as a
    power of two of log2(e)-scaled scores: MLX's CPU `exp` costs ~12.6 ns per element here against ~4.8
    for `power(2, x)`, and the exponentials are most of attention once a step has many query rows
    (one request verifying 4 drafts: -3%; 8 requests verifying 4 each: -11%; one decode row: equal).
    Rows do not mix: each query row's softmax and weighted sum read only its own scores."""
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
    """A step of random queries over a random paged cache, for kernel self-tests: `lens` per request
    (context before the step, tokens this step). Each request's blocks are numbered backwards, so a kernel
    that ignores the block table reads the wrong keys. Returns q [T, H, D], the key and value caches
    (head-major [Hkv, slots, D] or block-major [blocks, block_size, Hkv, D]) and the step's metadata."""
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
    """Why a kernel's output disagrees with the reference path's (None: it agrees within `tol`, absolute
    and relative)."""
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


AttentionBackend = Literal["auto", "metal", "cpu", "reference"]
# Compiled Metal kernels by name (metal_kernels/ops.py), each called with inputs, template, grid,
# threadgroup, output shapes and dtypes, init_value.
KernelSet = Mapping[str, Callable[..., list[mx.array]]]


@functools.cache
def _self_test_failures(backend: str) -> tuple[str, ...]:
    """The built-in kernels' self-test, run once per process."""
    if backend == "metal":
        from metal_kernels.ops import self_test
    else:
        from engine.cpu_attention import self_test
    return tuple(self_test())


def _failed_self_test(name: str, backend: AttentionBackend, failures: list[str] | tuple[str, ...]
                      ) -> tuple[Callable[..., mx.array], str]:
    """A kernel set that failed its start-up self-test: refused where it was asked for by name, else
    logged and replaced by the reference path."""
    msg = f"the {name} attention kernels failed their start-up self-test: {'; '.join(failures)}"
    if backend == name:
        raise ValueError(f"--attention-backend {name}: {msg}; use auto or reference")
    logger.warning("%s; using the reference path (MLX ops) instead", msg)
    return paged_attention_reference, f"reference (MLX ops; {msg})"


def select_attention(backend: AttentionBackend, *, metal_available: bool | None = None,
                     metal_kernels: KernelSet | None = None, cpu_kernel: Callable[..., mx.array] | None = None
                     ) -> tuple[Callable[..., mx.array], str]:
    """The attention function for `--attention-backend`, and a label for the start-up log.

    `auto` picks the Metal kernels when MLX has a Metal device, else the C kernel on an x86-64 CPU with
    AVX-512F (engine/cpu_attention.py), else the reference path; `metal` or `cpu` where it cannot run is
    a start-up error, not a silent fallback. Either kernel set first runs once on a small random case
    against the reference path (`self_test`): on an error or a mismatch `auto` logs it and takes the
    reference path, an explicit `metal` / `cpu` refuses to start. The C kernel also needs a float32
    head-major cache: the engine checks that (`cpu_attention_fits`). `metal_available`, `metal_kernels`
    and `cpu_kernel` replace the device check and the kernels under test (tests)."""
    if backend not in ("auto", "metal", "cpu", "reference"):
        raise ValueError(f"attention_backend must be auto, metal, cpu or reference, not {backend!r}")
    if backend == "reference":
        return paged_attention_reference, "reference (MLX ops: KV gather + attention; forced)"
    metal = mx.metal.is_available() if metal_available is None else metal_available
    if backend == "metal" or (backend == "auto" and metal):
        if not metal:
            raise ValueError("--attention-backend metal needs an Apple GPU (mx.metal.is_available() is False "
                             "here); use auto or reference")
        from metal_kernels.ops import paged_attention_metal, self_test

        failures = _self_test_failures("metal") if metal_kernels is None else self_test(metal_kernels)
        if failures:
            return _failed_self_test("metal", backend, failures)
        return paged_attention_metal, ("metal (paged_attention_decode / paged_attention_prefill kernels; "
                                       "prefill chunks over 128 tokens on the gather path)")
    from engine import cpu_attention

    why = cpu_attention.unsupported_reason()
    if why is None:
        failures = _self_test_failures("cpu") if cpu_kernel is None else cpu_attention.self_test(cpu_kernel)
        if failures:
            return _failed_self_test("cpu", backend, failures)
        return cpu_attention.cpu_paged_attention, "cpu (engine/cpu_attention.c over the paged cache)"
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
