"""A GGUF file's metadata and tensors off a memory map: Q4_0 / Q4_1 / Q8_0 as MLX's affine triples (group 32)
bit for bit, F32 / F16 / BF16 as stored, Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K matrices as their blocks' bytes,
every other type dequantized to float32 by the `gguf` package."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np

from engine.cpu.qgemm import BLOCK_FORMATS

# GGML's Q4_0, Q4_1 and Q8_0 use 32-value blocks.
GGML_GROUP_SIZE = 32

_VT = gguf.GGUFValueType
_SCALARS = {_VT.UINT8: "<B", _VT.INT8: "<b", _VT.UINT16: "<H", _VT.INT16: "<h", _VT.UINT32: "<I",
            _VT.INT32: "<i", _VT.FLOAT32: "<f", _VT.BOOL: "<?", _VT.UINT64: "<Q", _VT.INT64: "<q",
            _VT.FLOAT64: "<d"}
_QT = gguf.GGMLQuantizationType
# Block types MLX's affine quantization holds exactly: kept quantized.
_AFFINE_BITS = {_QT.Q4_0: 4, _QT.Q4_1: 4, _QT.Q8_0: 8}
# Read as stored; every other type is dequantized to float32.
_STORED = {_QT.F32, _QT.F16, _QT.BF16}
# GGML block types kept as the file stores them: those engine/cpu/blocks.h serves (weights.BlockLinear).
BLOCK_TYPES = {gguf.GGMLQuantizationType[name] for name in BLOCK_FORMATS}


def py_value(value: Any) -> Any:
    """A metadata value as plain Python (numeric arrays as numpy arrays)."""
    if isinstance(value, np.ndarray):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


@dataclass(frozen=True)
class Tensor:
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: GGUF lists the innermost dimension first
    data: np.ndarray  # uint8 [rows, bytes per row], memory-mapped


class _Header:
    """A GGUF file's metadata and tensor directory off a memory map (gguf's GGUFReader takes seconds over a
    large vocabulary)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.off = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.off)[0]
        self.off += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.off += n
        return self.buf[self.off - n:self.off].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _VT.STRING:
            return self.string()
        if vtype != _VT.ARRAY:
            return self.unpack(_SCALARS[_VT(vtype)])
        item, n = self.unpack("<I"), self.unpack("<Q")
        if item == _VT.STRING:
            return [self.string() for _ in range(n)]
        if item == _VT.ARRAY:
            return [self.value(_VT.ARRAY) for _ in range(n)]
        dt = np.dtype(_SCALARS[_VT(item)])
        arr = np.frombuffer(self.buf, dt, n, self.off).copy()
        self.off += n * dt.itemsize
        return arr


def read_file(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(metadata, tensors by name): metadata numbers as Python or numpy values, tensors as raw blocks."""
    h = _Header(path)
    if h.buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    h.off = 4
    version = h.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
    n_tensors, n_kv = h.unpack("<Q"), h.unpack("<Q")
    md: dict[str, Any] = {}
    for _ in range(n_kv):
        key = h.string()
        md[key] = h.value(h.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = h.string()
        dims = [h.unpack("<Q") for _ in range(h.unpack("<I"))]
        qtype, offset = h.unpack("<I"), h.unpack("<Q")
        infos.append((name, tuple(reversed(dims)), _QT(qtype), offset))
    align = int(md.get("general.alignment", 32))
    start = -(-h.off // align) * align
    tensors = {}
    for name, shape, qtype, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if shape[-1] % block:
            raise ValueError(f"GGUF tensor {name}: {shape[-1]} columns are not whole {qtype.name} blocks")
        rows = math.prod(shape[:-1])
        row_bytes = shape[-1] // block * size
        data = np.frombuffer(h.buf, np.uint8, rows * row_bytes, start + offset).reshape(rows, row_bytes)
        tensors[name] = Tensor(name, qtype, shape, data)
    return md, tensors


def _affine(t: Tensor) -> tuple[mx.array, mx.array, mx.array]:
    """A Q4_0 / Q4_1 / Q8_0 tensor as MLX's affine triple, bit for bit as mx.load builds it."""
    bits = _AFFINE_BITS[t.qtype]
    _, size = gguf.GGML_QUANT_SIZES[t.qtype]
    blocks = t.data.reshape(-1, size)
    scales = blocks[:, :2].copy().view(np.float16)
    if t.qtype == _QT.Q4_1:
        biases, qs = blocks[:, 2:4].copy().view(np.float16), blocks[:, 4:]
    else:
        biases, qs = np.float16(-(1 << (bits - 1))) * scales, blocks[:, 2:]
    if bits == 8:
        packed = qs ^ np.uint8(0x80)  # int8 -> uint8 + 128
    else:
        # GGML keeps elements j and j + 16 in byte j's low / high nibble; MLX packs neighbours.
        vals = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        packed = vals[:, 0::2] | (vals[:, 1::2] << 4)
    cols = t.shape[-1]
    weight = np.ascontiguousarray(packed).view(np.uint32).reshape(*t.shape[:-1], cols * bits // 32)
    groups = (*t.shape[:-1], cols // GGML_GROUP_SIZE)
    return mx.array(weight), mx.array(scales.reshape(groups)), mx.array(biases.reshape(groups))


def dense(t: Tensor) -> mx.array:
    if t.qtype == _QT.F32 or t.qtype == _QT.F16:
        return mx.array(t.data.view(np.float32 if t.qtype == _QT.F32 else np.float16).reshape(t.shape))
    if t.qtype == _QT.BF16:
        return mx.array(t.data.view(np.uint16).reshape(t.shape)).view(mx.bfloat16)
    try:
        values = gguf.quants.dequantize(t.data, t.qtype)
    except NotImplementedError as err:
        raise NotImplementedError(f"GGUF tensor {t.name}: type {t.qtype.name} cannot be read "
                                  "(the gguf package has no dequantizer for it)") from err
    return mx.array(values.astype(np.float32, copy=False).reshape(t.shape))


def model_dtype(types: set[gguf.GGMLQuantizationType]) -> mx.Dtype:
    """One float dtype for the model: float16 for F16 and Q4/Q8 scales, bfloat16 for BF16, else float32."""
    if not types <= {*_STORED, *_AFFINE_BITS}:
        return mx.float32  # dequantized values: float32 alone holds them exactly
    halves = {mx.bfloat16 if q == _QT.BF16 else mx.float16 for q in types - {_QT.F32}}
    return halves.pop() if len(halves) == 1 else mx.float32


def tensor_arrays(t: Tensor) -> dict[str, mx.array]:
    """The tensor's arrays by name: `x.weight`, or `x.weight` / `x.scales` / `x.biases` for a triple; a
    matrix of BLOCK_TYPES as its rows' bytes ([rows, row bytes] uint8)."""
    if t.qtype in BLOCK_TYPES and len(t.shape) == 2:
        return {t.name: mx.array(np.ascontiguousarray(t.data))}
    if t.qtype not in _AFFINE_BITS:
        return {t.name: dense(t)}
    base = t.name.removesuffix(".weight")
    return dict(zip((t.name, f"{base}.scales", f"{base}.biases"), _affine(t), strict=True))
