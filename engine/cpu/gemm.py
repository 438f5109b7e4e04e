"""Build and load `gemm.c`, a small-M float32 GEMM placed in front of the optimized BLAS.

MLX's CPU backend calls `cblas_sgemm` for every float32 matmul. Decode and draft verification run
matmuls with a few rows of activations (1 + K per verifying request, one per decoding request), where
MKL switches from its GEMV path to a far dearer GEMM path from 4 rows on; the kernel here streams the
weights once for up to 256 rows (prefill chunks included, where it also beats MKL) and takes any row
count, so that each row gets bitwise the result it would have alone whatever the step's size (see the
C file; figures: docs/design-notes.md). It is compiled once per source version and ISA with the system
C compiler into the model cache folder, and must be loaded before libmlx binds `cblas_sgemm`
(engine/blas.py does this). `SPECSERVE_SMALL_GEMM=off` turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from engine import envs
from engine.cpu.build import build_kernel, kernel_reason
from engine.cpu.threads import cpu_threads

SOURCE = Path(__file__).with_name("gemm.c")
# Every row count: a step over 256 rows (a prefill chunk beside verification rows) left to the BLAS
# would give its rows other bits than the same rows in a small step.
MAX_M = 2**31 - 1


def unsupported_reason() -> str | None:
    """Why the kernel cannot be used on this machine (None: it can)."""
    if envs.get("SPECSERVE_SMALL_GEMM") == "off":
        return "SPECSERVE_SMALL_GEMM=off"
    return kernel_reason()


def build(isa: str | None = None, out_dir: Path | None = None) -> Path:
    """Compile the library for `isa` (default: the selected one) if not built yet; returns its path."""
    return build_kernel(SOURCE, "small_gemm", isa, out_dir)


def load_before(blas: ctypes.CDLL) -> int:
    """Load the kernel with RTLD_GLOBAL, forwarding every call it does not handle to `blas`
    (already loaded, RTLD_LOCAL). Call before the BLAS is made global and before libmlx loads.
    Returns the largest row count it handles (MAX_M; 0: all calls forwarded)."""
    lib = ctypes.CDLL(str(build()), mode=ctypes.RTLD_GLOBAL)
    lib.small_gemm_init.restype = ctypes.c_int
    lib.small_gemm_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.small_gemm_threads.argtypes = [ctypes.c_int]
    cpu_threads().on_change(lib.small_gemm_threads)
    return int(lib.small_gemm_init(ctypes.cast(blas.cblas_sgemm, ctypes.c_void_p), MAX_M))
