"""The paged KV tensors: per layer, flat over slots (block * block_size + offset), so that slot writes
update the array in place (MLX donates a buffer whose only owner is the scatter). Two layouts:
- block-major `[num_blocks * block_size, num_kv_heads, head_dim]` (a free reshape of `[num_blocks,
  block_size, num_kv_heads, head_dim]`): what the Metal kernels read;
- head-major `[num_kv_heads, num_blocks * block_size, head_dim]`, the default on the CPU: gathering a
  group's blocks head by head lands directly in the layout attention takes, where the block-major gather
  needs a second, transposing copy (docs/cpu-backend.md).
"""

from __future__ import annotations

import mlx.core as mx


def head_major_default(layout: str = "auto") -> bool:
    """`kv_layout`: `head` or `block` as asked; `auto` is head-major where it pays (the CPU): the Metal
    kernels read block-major, and a CUDA device keeps the layout its numbers were taken with."""
    if layout in ("block", "head"):
        return layout == "head"
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
