"""Build and load `gemm.c`, the small-M float32 GEMM in front of the BLAS (docs/cpu-backend.md#small-m-gemm).
It must load before libmlx binds `cblas_sgemm` (engine/blas.py does this); `SPECSERVE_SMALL_GEMM=off`
turns it off."""

from __future__ import annotations

import ctypes
from pathlib import Path

from engine import envs
from engine.cpu.build import build_kernel, kernel_reason
from engine.cpu.threads import cpu_threads

SOURCE = Path(__file__).with_name("gemm.c")
# Every row count: rows left to the BLAS would get other bits than the same rows in a small step.
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
