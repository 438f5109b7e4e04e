"""Python wrappers over the Metal kernels in `shaders/` (JIT through `mx.fast.metal_kernel`). Launch planning
(`plan_decode`, `group_rows`) is shared with the NumPy emulation in `emulate.py`, so the index arithmetic
checked without Metal is the shader's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine.attention.reference import (
    assemble_groups,
    group_attention_reference,
    random_case,
    reference_mismatch,
)
from engine.attention.types import AttentionGroup, AttentionMetadata, KernelSet

SHADERS = Path(__file__).with_name("shaders")
LANES = 32  # one SIMD group per (row, head, partition)
HEAD_DIMS = (64, 128, 256, 512)  # 512: Gemma4's full-attention layers (256 on its sliding ones)
BLOCK_SIZES = (8, 16, 32)
# Contexts longer than this are split into partitions of SPLIT_PARTITION keys plus a reduce launch,
# so a long sequence is spread over more SIMD groups than heads x rows.
SPLIT_THRESHOLD = 1024
SPLIT_PARTITION = 512
# Query lengths per request up to this use the decode kernel, up to PREFILL_KERNEL_MAX_QUERY_LEN the tiled
# prefill kernel; longer chunks are compute-bound and stay on the gather path (metal_kernels/README.md).
DECODE_MAX_QUERY_LEN = 16
PREFILL_KERNEL_MAX_QUERY_LEN = 128
PREFILL_Q_TILE = 8  # query rows (SIMD groups) per threadgroup sharing one K/V tile
PREFILL_TILE_FLOATS = 2048  # K/V tile size per threadgroup in floats: 2 x 8 KiB of threadgroup memory
# Value every kernel output starts as (MLX's init_value); None leaves outputs uninitialised (no fill
# pass). The Metal tests set NaN so an element a kernel never writes fails the comparison.
OUTPUT_INIT: float | None = None


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    num_rows: int
    num_heads: int
    head_dim: int
    block_size: int
    partition_size: int
    num_partitions: int

    @property
    def split(self) -> bool:
        return self.num_partitions > 1

    @property
    def grid(self) -> tuple[int, int, int]:
        return (LANES * self.num_partitions, self.num_heads, self.num_rows)

    @property
    def threadgroup(self) -> tuple[int, int, int]:
        return (LANES, 1, 1)

    @property
    def reduce_grid(self) -> tuple[int, int, int]:
        return (self.head_dim, self.num_heads, self.num_rows)

    @property
    def reduce_threadgroup(self) -> tuple[int, int, int]:
        return (min(self.head_dim, 256), 1, 1)


def plan_decode(num_rows: int, num_heads: int, head_dim: int, block_size: int, max_ctx: int,
                partition_size: int | None = None) -> DecodeLaunch:
    """Launch shape for `max_ctx` keys at most per row (a partition size forces the split variant)."""
    if head_dim % LANES:
        raise ValueError(f"head_dim {head_dim} is not a multiple of {LANES}")
    if partition_size is None:
        partition_size = SPLIT_PARTITION if max_ctx > SPLIT_THRESHOLD else max(max_ctx, 1)
    num_partitions = max(1, -(-max_ctx // partition_size))
    return DecodeLaunch(num_rows, num_heads, head_dim, block_size, partition_size, num_partitions)


@dataclass(frozen=True, slots=True)
class PrefillLaunch:
    num_seqs: int
    q_len: int
    num_heads: int
    head_dim: int
    block_size: int
    q_tile: int
    kv_tile: int

    @property
    def tiles_per_seq(self) -> int:
        return -(-self.q_len // self.q_tile)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (LANES * self.num_heads, self.q_tile, self.num_seqs * self.tiles_per_seq)

    @property
    def threadgroup(self) -> tuple[int, int, int]:
        return (LANES, self.q_tile, 1)


def plan_prefill(num_seqs: int, q_len: int, num_heads: int, head_dim: int, block_size: int,
                 q_tile: int = PREFILL_Q_TILE) -> PrefillLaunch:
    """Launch shape for `num_seqs` sequences of `q_len` query rows each (rows laid out seq-major)."""
    if head_dim % LANES:
        raise ValueError(f"head_dim {head_dim} is not a multiple of {LANES}")
    kv_tile = max(1, PREFILL_TILE_FLOATS // head_dim)  # 32 / 16 / 8 keys for head sizes 64 / 128 / 256
    return PrefillLaunch(num_seqs, q_len, num_heads, head_dim, block_size, q_tile, kv_tile)


def group_rows(g: AttentionGroup) -> tuple[mx.array, mx.array]:
    """Per query row of a group ([R, L] -> R * L rows): block-table row and visible keys.
    Padding rows repeat a valid query and are dropped by the caller's out_index."""
    seq = mx.repeat(mx.arange(g.num_rows, dtype=mx.int32), g.max_len)
    ctx = g.q_pos.reshape(-1) + 1
    return seq, ctx


def _source(name: str, tail: str | None = None) -> str:
    text = (SHADERS / f"{name}.metal").read_text()
    if tail is None:
        return text
    body, tails = text.split("// ---- write: split ----\n")
    split_tail, direct_tail = tails.split("// ---- write: direct ----\n")
    return body + (split_tail if tail == "split" else direct_tail)


@functools.cache
def _kernels() -> dict[str, Callable[..., list[mx.array]]]:
    fk = mx.fast.metal_kernel
    inputs = ["q", "k_cache", "v_cache", "block_tables", "q_seq", "q_ctx", "params"]
    return {
        "decode_split": fk(name="specserve_paged_attention_decode_split", input_names=inputs,
                           output_names=["part_acc", "part_max", "part_sum"],
                           source=_source("paged_attention_decode", "split")),
        "decode_direct": fk(name="specserve_paged_attention_decode", input_names=inputs,
                            output_names=["out"], source=_source("paged_attention_decode", "direct")),
        "reduce": fk(name="specserve_paged_attention_reduce",
                     input_names=["part_acc", "part_max", "part_sum"], output_names=["out"],
                     source=_source("paged_attention_reduce")),
        "prefill": fk(name="specserve_paged_attention_prefill",
                      input_names=["q", "k_cache", "v_cache", "block_tables", "q_ctx", "params"],
                      output_names=["out"], source=_source("paged_attention_prefill")),
        "cache": fk(name="specserve_reshape_and_cache",
                    input_names=["key", "value", "key_cache", "value_cache", "slot_to_token"],
                    output_names=["key_cache_out", "value_cache_out"], source=_source("reshape_and_cache")),
    }


def paged_attention_decode(q: mx.array, k_cache: mx.array, v_cache: mx.array, block_tables: mx.array,
                           q_seq: mx.array, q_ctx: mx.array, block_size: int, scale: float,
                           softcap: float = 0.0, window: int | None = None, max_ctx: int | None = None,
                           partition_size: int | None = None, kernels: KernelSet | None = None) -> mx.array:
    """q [R, H, D]; caches [num_slots, Hkv, D]; block_tables [S, max_blocks]; q_seq/q_ctx [R].
    Returns [R, H, D] in q's dtype. `kernels`: the compiled kernels (default: the shaders')."""
    R, H, D = q.shape
    bs = block_size
    launch = plan_decode(R, H, D, bs, max_ctx or block_tables.shape[1] * bs, partition_size)
    params = mx.array([scale, softcap, float(window or 0), float(launch.num_partitions)], dtype=mx.float32)
    template = [("T", q.dtype), ("HEAD_DIM", D), ("BLOCK_SIZE", bs),
                ("PARTITION_SIZE", launch.partition_size)]
    args = [q, k_cache, v_cache, block_tables.astype(mx.int32), q_seq.astype(mx.int32),
            q_ctx.astype(mx.int32), params]
    k = kernels if kernels is not None else _kernels()
    if not launch.split:
        return k["decode_direct"](inputs=args, template=template, grid=launch.grid,
                                  threadgroup=launch.threadgroup, output_shapes=[(R, H, D)],
                                  output_dtypes=[q.dtype], init_value=OUTPUT_INIT)[0]
    P = launch.num_partitions
    acc, mmax, msum = k["decode_split"](
        inputs=args, template=template, grid=launch.grid, threadgroup=launch.threadgroup,
        output_shapes=[(R, H, P, D), (R, H, P), (R, H, P)],
        output_dtypes=[mx.float32, mx.float32, mx.float32], init_value=OUTPUT_INIT)
    return k["reduce"](inputs=[acc, mmax, msum], template=[("T", q.dtype), ("HEAD_DIM", D)],
                       grid=launch.reduce_grid, threadgroup=launch.reduce_threadgroup,
                       output_shapes=[(R, H, D)], output_dtypes=[q.dtype], init_value=OUTPUT_INIT)[0]


def paged_attention_prefill(q: mx.array, k_cache: mx.array, v_cache: mx.array, block_tables: mx.array,
                            q_ctx: mx.array, block_size: int, scale: float, softcap: float = 0.0,
                            window: int | None = None, kernels: KernelSet | None = None) -> mx.array:
    """q [S * L, H, D] (sequence-major); caches [num_slots, Hkv, D]; block_tables [S, max_blocks];
    q_ctx [S * L]. Returns [S * L, H, D] in q's dtype."""
    rows, H, D = q.shape
    S = block_tables.shape[0]
    launch = plan_prefill(S, rows // S, H, D, block_size)
    params = mx.array([scale, softcap, float(window or 0), float(launch.q_len), float(launch.tiles_per_seq)],
                      dtype=mx.float32)
    template = [("T", q.dtype), ("HEAD_DIM", D), ("BLOCK_SIZE", block_size), ("Q_TILE", launch.q_tile),
                ("KV_TILE", launch.kv_tile)]
    return (kernels if kernels is not None else _kernels())["prefill"](
        inputs=[q, k_cache, v_cache, block_tables.astype(mx.int32), q_ctx.astype(mx.int32), params],
        template=template, grid=launch.grid, threadgroup=launch.threadgroup, output_shapes=[(rows, H, D)],
        output_dtypes=[q.dtype], init_value=OUTPUT_INIT)[0]


def slot_to_token(slot_mapping: mx.array, num_slots: int) -> mx.array:
    """Inverse of slot_mapping ([T] slots -> [num_slots] token index or -1)."""
    inv = mx.full((num_slots,), -1, dtype=mx.int32)
    inv[slot_mapping] = mx.arange(slot_mapping.shape[0], dtype=mx.int32)
    return inv


def reshape_and_cache(key: mx.array, value: mx.array, key_cache: mx.array, value_cache: mx.array,
                      slot_mapping: mx.array, kernels: KernelSet | None = None) -> tuple[mx.array, mx.array]:
    """key/value [T, Hkv, D] into caches [num_slots, Hkv, D]; returns the updated caches."""
    n = key_cache.size
    out = (kernels if kernels is not None else _kernels())["cache"](
        inputs=[key.astype(key_cache.dtype), value.astype(value_cache.dtype), key_cache, value_cache,
                slot_to_token(slot_mapping, key_cache.shape[0])],
        template=[("HEAD_DIM", key_cache.shape[2])], grid=(n, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[key_cache.shape, value_cache.shape],
        output_dtypes=[key_cache.dtype, value_cache.dtype], init_value=OUTPUT_INIT)
    return out[0], out[1]


def group_attention_metal(q: mx.array, k_blocks: mx.array, v_blocks: mx.array, g: AttentionGroup,
                          scale: float, window: int | None = None, *, kernels: KernelSet | None = None,
                          partition_size: int | None = None) -> mx.array:
    """The engine's per-group attention on Metal: decode/verification groups go to the decode kernel,
    prefill chunks up to PREFILL_KERNEL_MAX_QUERY_LEN tokens to the prefill kernel (neither gathers a
    contiguous copy of the blocks), longer chunks to the gather path. `partition_size` forces the
    split-KV decode variant (self-test)."""
    nb, bs, hkv, d = k_blocks.shape
    if g.max_len > PREFILL_KERNEL_MAX_QUERY_LEN or d not in HEAD_DIMS:
        return group_attention_reference(q, k_blocks, v_blocks, g, scale, window)
    rows = q if g.identity else q[g.q_index.reshape(-1)]  # identity: already [R * L, H, D] in order
    seq, ctx = group_rows(g)
    k_flat, v_flat = k_blocks.reshape(nb * bs, hkv, d), v_blocks.reshape(nb * bs, hkv, d)
    if g.max_len > DECODE_MAX_QUERY_LEN:
        return paged_attention_prefill(rows, k_flat, v_flat, g.block_tables, ctx, bs, scale, window=window,
                                       kernels=kernels)
    return paged_attention_decode(rows, k_flat, v_flat, g.block_tables, seq, ctx, bs, scale,
                                  window=window, max_ctx=g.block_tables.shape[1] * bs,
                                  partition_size=partition_size, kernels=kernels)


def paged_attention_metal(q: mx.array, k_blocks: mx.array, v_blocks: mx.array, meta: AttentionMetadata,
                          scale: float, window: int | None = None) -> mx.array:
    return assemble_groups(q, k_blocks, v_blocks, meta, scale, window, group_attention_metal)


# Tolerance of a self-test comparison with the reference path, per dtype (the kernels accumulate in
# float32; the reference rounds in the model dtype).
SELF_TEST_TOL = {mx.float32: 2e-4, mx.float16: 2e-2, mx.bfloat16: 5e-2}


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def self_test(kernels: KernelSet | None = None,
              dtypes: tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)) -> list[str]:
    """Run each kernel once per dtype on a small random step against the reference path (MLX ops):
    decode rows and verification rows (direct decode kernel; split-KV kernel + reduce, with a sliding
    window), a 20-token chunk (prefill kernel), a cache write. Returns one line per kernel that failed to
    compile, raised or disagreed; empty when all passed. `kernels`: the compiled kernels (default: the
    shaders'); tests pass stand-ins."""
    failures: list[str] = []
    checks = (("decode", None, None), ("decode_split + reduce", 16, 24), ("prefill", None, None))
    for dtype in dtypes:
        tol = SELF_TEST_TOL.get(dtype, 5e-2)
        q, kb, vb, meta = random_case([(5, 1), (20, 1), (33, 3), (7, 20)], block_size=16, head_dim=64,
                                      num_heads=4, num_kv_heads=2, head_major=False, dtype=dtype)
        for name, partition, window in checks:
            groups = [g for g in meta.groups if (g.max_len > DECODE_MAX_QUERY_LEN) == (name == "prefill")]
            try:
                for g in groups:
                    got = group_attention_metal(q, kb, vb, g, 0.125, window, kernels=kernels,
                                                partition_size=partition)
                    why = reference_mismatch(got, group_attention_reference(q, kb, vb, g, 0.125, window), tol)
                    if why:
                        failures.append(f"{name} ({_dtype_name(dtype)}): {why}")
                        break
            except Exception as e:  # a compile error surfaces here, at the first evaluation
                failures.append(f"{name} ({_dtype_name(dtype)}): {type(e).__name__}: {e}")
        try:
            nb, bs, hkv, d = kb.shape
            slots = mx.array([0, bs - 1, bs, 3 * bs + 2], dtype=mx.int32)
            k_new, v_new = q[:4, :hkv], q[4:8, :hkv]
            k_flat, v_flat = kb.reshape(-1, hkv, d), vb.reshape(-1, hkv, d)
            k_out, v_out = reshape_and_cache(k_new, v_new, k_flat, v_flat, slots, kernels=kernels)
            k_want, v_want = mx.array(k_flat), mx.array(v_flat)
            k_want[slots], v_want[slots] = k_new, v_new
            why = reference_mismatch(k_out, k_want, 0.0) or reference_mismatch(v_out, v_want, 0.0)
            if why:
                failures.append(f"reshape_and_cache ({_dtype_name(dtype)}): {why}")
        except Exception as e:
            failures.append(f"reshape_and_cache ({_dtype_name(dtype)}): {type(e).__name__}: {e}")
    return failures
