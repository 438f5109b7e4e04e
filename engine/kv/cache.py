"""The paged KV tensors: per layer, flat over slots (block * block_size + offset), so that slot writes
update the array in place (MLX donates a buffer whose only owner is the scatter). Two layouts:
- block-major `[num_blocks * block_size, num_kv_heads, head_dim]` (a free reshape of `[num_blocks,
  block_size, num_kv_heads, head_dim]`): what the Metal kernels read;
- head-major `[num_kv_heads, num_blocks * block_size, head_dim]`, the default on the CPU: gathering a
  group's blocks head by head lands directly in the layout attention takes, where the block-major gather
  needs a second, transposing copy (docs/cpu-backend.md).

Each layer has its own (KV heads, head size): Gemma4's full-attention layers are wider than its sliding
ones. A layer that reuses another's KV (Gemma4's KV-shared layers) has no tensors. One block table serves
every layer, so the block manager counts blocks and this class turns a block into bytes.
"""

from __future__ import annotations

import mlx.core as mx

KVShape = tuple[int, int]  # (num_kv_heads, head_dim) of one layer's KV


def uniform_shape(shapes: list[KVShape | None]) -> KVShape | None:
    """The one (KV heads, head size) of every layer, None where layers differ or some store none."""
    first = shapes[0] if shapes else None
    return first if all(s == first for s in shapes) else None


def head_major_default(layout: str = "auto") -> bool:
    """`kv_layout`: `head` or `block` as asked; `auto` is head-major where it pays (the CPU): the Metal
    kernels read block-major, and a CUDA device keeps the layout its numbers were taken with."""
    if layout in ("block", "head"):
        return layout == "head"
    return not mx.metal.is_available() and mx.default_device() == mx.cpu


class PagedKVCache:
    def __init__(self, shapes: list[KVShape | None], num_blocks: int, block_size: int, dtype: mx.Dtype,
                 head_major: bool | None = None) -> None:
        """`shapes`: per layer, the (KV heads, head size) it stores, or None for a layer that stores none."""
        self.shapes = list(shapes)
        self.num_layers = len(self.shapes)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.head_major = head_major_default() if head_major is None else head_major
        slots = num_blocks * block_size
        self.k: list[mx.array | None] = []
        self.v: list[mx.array | None] = []
        for s in self.shapes:
            if s is None:
                self.k.append(None)
                self.v.append(None)
                continue
            n_kv, d = s
            shape = (n_kv, slots, d) if self.head_major else (slots, n_kv, d)
            self.k.append(mx.zeros(shape, dtype=dtype))
            self.v.append(mx.zeros(shape, dtype=dtype))
        mx.eval([a for a in self.k + self.v if a is not None])

    @staticmethod
    def bytes_per_block(shapes: list[KVShape | None], block_size: int, dtype: mx.Dtype) -> int:
        return sum(2 * block_size * n_kv * d * dtype.size for n_kv, d in (s for s in shapes if s is not None))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v if a is not None)

    def uniform_shape(self) -> KVShape | None:
        return uniform_shape(self.shapes)

    def _tensors(self, layer: int) -> tuple[mx.array, mx.array]:
        k, v = self.k[layer], self.v[layer]
        if k is None or v is None:
            raise ValueError(f"layer {layer} stores no KV (it reads another layer's)")
        return k, v

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        # slots: [T], k/v: [T, num_kv_heads, head_dim]
        kc, vc = self._tensors(layer)
        if self.head_major:
            kc[:, slots] = k.transpose(1, 0, 2).astype(self.dtype)
            vc[:, slots] = v.transpose(1, 0, 2).astype(self.dtype)
        else:
            kc[slots] = k.astype(self.dtype)
            vc[slots] = v.astype(self.dtype)

    def blocks(self, layer: int) -> tuple[mx.array, mx.array]:
        """What attention reads: head-major `[Hkv, slots, D]` as stored, or block-major
        `[num_blocks, block_size, Hkv, D]` (attention tells them apart by their number of axes)."""
        k, v = self._tensors(layer)
        if self.head_major:
            return k, v
        n_kv, d = self.shapes[layer]  # type: ignore[misc]
        shape = (self.num_blocks, self.block_size, n_kv, d)
        return k.reshape(shape), v.reshape(shape)
