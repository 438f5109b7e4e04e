"""What attention kernels share: a step's layout and the backend names. Imports nothing from the engine, so
the Metal kernels can use it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx
import numpy as np

# Requests computing more tokens than this in a step get their own attention call.
_PAD_GROUP_MAX_TOKENS = 16


@dataclass(slots=True)
class AttentionGroup:
    """Requests of one query length attended in one call: queries [R, L], keys gathered from their blocks."""

    q_index: mx.array  # [R, L] int32 rows of the flat token batch
    q_pos: mx.array  # [R, L] int32 absolute positions
    block_tables: mx.array  # [R, NB] int32 (shorter tables padded with block 0, masked out)
    num_rows: int
    max_len: int
    block_size: int
    # The whole batch in order (pure decode, or one request): queries and outputs are reshapes.
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
        # [Hkv * R * NB] int32: rows of a head-major cache as [Hkv * num_blocks, block_size * D], by head,
        # request, block.
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
    """The step's layout as NumPy int32 arrays, for attention written in C (engine/cpu/attention.py)."""

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

    # One group per query length up to _PAD_GROUP_MAX_TOKENS (no short row padded to a longer one); each
    # long chunk is a group of its own.
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


AttentionBackend = Literal["auto", "metal", "cpu", "reference"]
# Compiled Metal kernels by name (metal_kernels/ops.py).
KernelSet = Mapping[str, Callable[..., list[mx.array]]]
