"""The paged KV tensors, per layer and flat over slots so that writes update in place: head-major on the CPU,
block-major for the Metal kernels; one block table serves every layer (docs/architecture.md)."""

from __future__ import annotations

import mlx.core as mx

KVShape = tuple[int, int]  # (num_kv_heads, head_dim) of one layer's KV


def uniform_shape(shapes: list[KVShape | None]) -> KVShape | None:
    """The one (KV heads, head size) of every layer, None where layers differ or some store none."""
    first = shapes[0] if shapes else None
    return first if all(s == first for s in shapes) else None


def head_major_default(layout: str = "auto") -> bool:
    """`kv_layout`: `head` or `block`; `auto` is head-major on the CPU (the Metal kernels read block-major,
    CUDA keeps the layout its numbers were taken with)."""
    if layout in ("block", "head"):
        return layout == "head"
    return not mx.metal.is_available() and mx.default_device() == mx.cpu


class PagedKVCache:
    def __init__(self, shapes: list[KVShape | None], num_blocks: int, block_size: int, dtype: mx.Dtype,
                 head_major: bool | None = None) -> None:
        """`shapes`: per layer, the (KV heads, head size) it stores (None: none)."""
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
        """What attention reads: head-major `[Hkv, slots, D]` or block-major `[blocks, bs, Hkv, D]`."""
        k, v = self._tensors(layer)
        if self.head_major:
            return k, v
        n_kv, d = self.shapes[layer]  # type: ignore[misc]
        shape = (self.num_blocks, self.block_size, n_kv, d)
        return k.reshape(shape), v.reshape(shape)
