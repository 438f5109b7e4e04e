"""Build and call `qgemm.c`, the small-M GEMM over float32 / bf16 / fp16 / MLX affine 8- and 4-bit weights
and GGML's block formats (blocks.h), between MLX graphs on a CPU with a kernel ISA (docs/cpu-backend.md);
elsewhere MLX's own matmuls run."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.cpu.build import build_kernel, cpu_kernel_reason, selected_isa
from engine.cpu.host import host_view, pointer
from engine.cpu.threads import cpu_threads

SOURCE = Path(__file__).with_name("qgemm.c")
FORMATS = {"bf16": 1, "f16": 2, "q8": 3, "q4": 4, "f32": 5}
MAX_GROUPS = 1024  # qgemm.c: groups per weight row
_SCALE_DTYPES = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}


# Where `--activation-precision auto` takes 8-bit activations: the ISAs whose int8 kernel beats their 4-bit
# float kernel (docs/cpu-backend.md).
INT8_AUTO_ISAS = frozenset({"avx2"})


def int8_by_default(isa: str | None = None) -> bool:
    """Whether `auto` activation precision means int8 on this ISA (the selected one by default)."""
    return (isa or selected_isa()) in INT8_AUTO_ISAS


def unsupported_reason(isa: str | None = None) -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return cpu_kernel_reason(lambda: _lib(isa), "engine/cpu/qgemm.c", isa)


def _lib(isa: str | None = None) -> ctypes.CDLL:
    return _lib_for(isa or selected_isa())


@functools.cache
def _lib_for(isa: str | None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_kernel(SOURCE, "qgemm", isa)))
    i, p = ctypes.c_int, ctypes.c_void_p
    lib.qgemm.restype = i
    lib.qgemm.argtypes = [i, i, i, i, i, p, i, p, p, p, i, p, i, i]
    lib.qgemm_i8.restype = i
    lib.qgemm_i8.argtypes = lib.qgemm.argtypes
    lib.qgemm_rows.restype = i
    lib.qgemm_rows.argtypes = [i, i, i, i, p, p, p, i, p, i, p]
    lib.qgemm_blocks.restype = i
    lib.qgemm_blocks.argtypes = [i, i, i, i, p, i, p, p, i, i]
    lib.qgemm_blocks_rows.restype = i
    lib.qgemm_blocks_rows.argtypes = [i, i, i, p, p, i, p]
    return lib


@dataclass(slots=True)
class PackedWeights:
    """One weight matrix [N, K] in a format the kernel reads, with host views kept alive."""

    fmt: str  # a key of FORMATS
    n: int
    k: int
    group: int  # quantization group size (0 for float formats)
    arrays: tuple[mx.array, ...]  # the MLX arrays the views point into (kept alive)
    views: tuple[np.ndarray, ...]  # weight, scales, biases (the latter two absent for floats)
    scale_dtype: int
    int8: bool = False  # products take 8-bit activations (set only where `int8_serves`)

    @classmethod
    def floats(cls, w: mx.array) -> PackedWeights:
        fmt = {mx.bfloat16: "bf16", mx.float16: "f16", mx.float32: "f32"}[w.dtype]
        w = mx.contiguous(w)
        return cls(fmt, w.shape[0], w.shape[1], 0, (w,), (host_view(w),), 0)

    @classmethod
    def affine(cls, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
               bits: int) -> PackedWeights:
        if bits not in (4, 8):
            raise ValueError(f"qgemm: {bits}-bit weights are not supported (4 or 8)")
        n, k = w.shape[0], w.shape[1] * 32 // bits
        arrays = tuple(mx.contiguous(a) for a in (w, scales, biases))
        return cls(f"q{bits}", n, k, group_size, arrays, tuple(host_view(a) for a in arrays),
                   _SCALE_DTYPES[scales.dtype])

    def supported(self) -> bool:
        """Whether the kernel reads this layout (qgemm.c refuses the rest)."""
        if self.k % 16:
            return False
        if self.group == 0:
            return True
        step = 32 if self.fmt == "q4" else 16
        return self.group % step == 0 and self.k % self.group == 0 and self.k // self.group <= MAX_GROUPS

    def int8_serves(self) -> bool:
        """Whether the int8-activation kernel reads these weights (4- or 8-bit, groups of 32 x a power of
        two)."""
        blocks = self.group // 32
        return self.fmt in ("q4", "q8") and self.group % 32 == 0 and self.supported() and \
            blocks & (blocks - 1) == 0

    def pointers(self) -> tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]:
        """Weights, scales, biases as the kernel takes them (floats: the weights thrice, unread)."""
        w = self.views[0]
        return pointer(w), pointer(self.views[1] if len(self.views) > 1 else w), \
            pointer(self.views[2] if len(self.views) > 2 else w)


# GGML's block formats served as stored (engine/cpu/blocks.h): name -> (GGML type id, weights per block,
# bytes per block).
BLOCK_FORMATS = {"Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
                 "Q6_K": (14, 256, 210)}


@dataclass(slots=True)
class BlockWeights:
    """One weight matrix [N, K] in a GGML block format, its rows as the file stores them ([N, row bytes]
    uint8), multiplied with 8-bit activations only (engine/cpu/blocks.h)."""

    qtype: str  # a key of BLOCK_FORMATS
    n: int
    k: int
    blocks: mx.array  # kept alive
    view: np.ndarray
    group = 0
    int8 = True

    @classmethod
    def of(cls, qtype: str, blocks: mx.array, k: int) -> BlockWeights:
        _, per, size = BLOCK_FORMATS[qtype]
        if blocks.dtype != mx.uint8 or blocks.ndim != 2 or k % per or blocks.shape[1] != k // per * size:
            raise ValueError(f"{qtype} weights of {k} columns are [N, {k // per * size}] bytes, got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        blocks = mx.contiguous(blocks)
        return cls(qtype, blocks.shape[0], k, blocks, host_view(blocks))

    @property
    def fmt(self) -> str:
        return self.qtype

    def supported(self) -> bool:
        return self.k // 32 <= MAX_GROUPS

    def int8_serves(self) -> bool:
        return True


def blocks_host(x: np.ndarray, bw: BlockWeights, max_threads: int = 0, isa: str | None = None) -> np.ndarray:
    """x: [M, K] float32 (row-contiguous) -> [M, N] float32, rows of x quantized to 8 bits per 32 values."""
    out = np.empty((x.shape[0], bw.n), dtype=np.float32)
    rc = _lib(isa).qgemm_blocks(BLOCK_FORMATS[bw.qtype][0], x.shape[0], bw.n, bw.k, pointer(x), x.shape[1],
                                pointer(bw.view), pointer(out), bw.n, max_threads)
    if rc != 0:
        raise ValueError(f"qgemm refused {bw.qtype} [{bw.n}, {bw.k}]")
    return out


def block_rows_host(ids: np.ndarray, bw: BlockWeights, isa: str | None = None) -> np.ndarray:
    """Rows `ids` of a block-format matrix as float32 [len(ids), K], valued as GGML dequantizes them."""
    ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
    out = np.empty((ids.size, bw.k), dtype=np.float32)
    rc = _lib(isa).qgemm_blocks_rows(BLOCK_FORMATS[bw.qtype][0], bw.n, bw.k, pointer(bw.view), pointer(ids),
                                     ids.size, pointer(out))
    if rc != 0:
        raise ValueError(f"token ids out of range for a [{bw.n}, {bw.k}] table")
    return out


def qgemm_host(x: np.ndarray, pw: PackedWeights | BlockWeights, max_threads: int = 0, isa: str | None = None,
               int8: bool = False) -> np.ndarray:
    """x: [M, K] float32 (row-contiguous) -> [M, N] float32. `int8`: rows of x quantized to 8 bits per 32
    values (4- and 8-bit weights; block formats always)."""
    if isinstance(pw, BlockWeights):
        return blocks_host(x, pw, max_threads, isa)
    m = x.shape[0]
    out = np.empty((m, pw.n), dtype=np.float32)
    fn = _lib(isa).qgemm_i8 if int8 else _lib(isa).qgemm
    rc = fn(FORMATS[pw.fmt], m, pw.n, pw.k, pw.group, pointer(x), x.shape[1], *pw.pointers(),
            pw.scale_dtype, pointer(out), pw.n, max_threads)
    if rc != 0:
        raise ValueError(f"qgemm refused {pw.fmt} [{pw.n}, {pw.k}] group {pw.group}")
    return out


def rows_host(ids: np.ndarray, pw: PackedWeights | BlockWeights, isa: str | None = None) -> np.ndarray:
    """Rows `ids` of the weight matrix as float32 [len(ids), K] (an embedding lookup)."""
    if isinstance(pw, BlockWeights):
        return block_rows_host(ids, pw, isa)
    ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
    out = np.empty((ids.size, pw.k), dtype=np.float32)
    rc = _lib(isa).qgemm_rows(FORMATS[pw.fmt], pw.n, pw.k, pw.group, *pw.pointers(), pw.scale_dtype,
                           pointer(ids), ids.size, pointer(out))
    if rc != 0:
        raise ValueError(f"token ids out of range for a [{pw.n}, {pw.k}] table")
    return out


def qgemm(x: mx.array, pw: PackedWeights | BlockWeights) -> mx.array:
    """x: [..., K] -> [..., N] float32, x @ dequant(W).T."""
    lead = x.shape[:-1]
    if x.size == 0:  # a step whose rows are all prefill without logits
        return mx.zeros((*lead, pw.n), dtype=mx.float32)
    x2 = mx.contiguous(x.reshape(-1, pw.k).astype(mx.float32))
    mx.eval(x2)
    host = np.asarray(memoryview(x2))  # type: ignore[arg-type]  # stub lacks the buffer protocol
    return mx.array(qgemm_host(host, pw, cpu_threads().count(), int8=pw.int8)).reshape(*lead, pw.n)
