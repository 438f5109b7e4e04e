"""Load an optimized BLAS with RTLD_GLOBAL before `mlx` is first imported, so libmlx's `cblas_sgemm` binds to
it (`SPECSERVE_BLAS`: auto, mkl, openblas, reference or a library path; docs/cpu-backend.md#blas)."""

from __future__ import annotations

import ctypes
import glob
import os
import subprocess
import sys
from dataclasses import dataclass

from engine import envs
from engine.cpu import gemm as small_gemm

_DEBIAN_OPENBLAS = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
]


@dataclass(slots=True)
class BlasInfo:
    name: str  # "mkl", "openblas", "reference", "accelerate", "custom"
    path: str | None
    reason: str
    # The small-M GEMM in front of the BLAS (engine/cpu/gemm.py): "rows: all", or why it is off.
    small_gemm: str = "off"


_selected: BlasInfo | None = None


def _find_mkl() -> str | None:
    # The `mkl` wheel installs libmkl_rt into <prefix>/lib.
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]):
        hits = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
        if hits:
            return hits[0]
    return None


def _find_openblas() -> str | None:
    return next((p for p in _DEBIAN_OPENBLAS if os.path.exists(p)), None)


def _load(path: str) -> tuple[bool, str]:
    """Load the BLAS into the global scope, the small-M GEMM ahead of it -> (loaded, small-GEMM status)."""
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    except OSError:
        return False, "off"
    if not hasattr(lib, "cblas_sgemm"):
        return False, "off"
    status = _small_gemm_before(lib)
    # Made global after the kernel: libmlx binds cblas_sgemm to the kernel, every other symbol here.
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return True, status


def _small_gemm_before(lib: ctypes.CDLL) -> str:
    why = small_gemm.unsupported_reason()
    if why is not None:
        return f"off ({why})"
    try:
        max_m = small_gemm.load_before(lib)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"off (build failed: {e})"
    return "rows: all" if max_m else "off (calls forwarded)"


def select_blas() -> BlasInfo:
    """Load the chosen BLAS once; safe to call many times. Must run before `import mlx`."""
    global _selected
    if _selected is not None:
        return _selected
    choice = envs.get("SPECSERVE_BLAS")
    if sys.platform == "darwin":
        _selected = BlasInfo("accelerate", None, "macOS: MLX uses Accelerate / Metal")
        return _selected
    if "mlx.core" in sys.modules and choice != "reference":
        _selected = BlasInfo("unknown", None, "mlx was imported before specserve could choose a BLAS")
        return _selected
    if choice == "reference":
        _selected = BlasInfo("reference", None, "SPECSERVE_BLAS=reference")
        return _selected
    candidates: list[tuple[str, str | None]]
    if choice == "auto":
        candidates = [("mkl", _find_mkl()), ("openblas", _find_openblas())]
    elif choice == "mkl":
        candidates = [("mkl", _find_mkl())]
    elif choice == "openblas":
        candidates = [("openblas", _find_openblas())]
    else:
        candidates = [("custom", choice)]
    for name, path in candidates:
        if not path:
            continue
        loaded, small = _load(path)
        if loaded:
            _selected = BlasInfo(name, path, f"SPECSERVE_BLAS={choice}", small)
            return _selected
    if choice not in ("auto",):
        raise RuntimeError(f"SPECSERVE_BLAS={choice!r}: library not found or not loadable")
    _selected = BlasInfo("reference", None, "no optimized BLAS found (pip install mkl, or apt install "
                         "libopenblas0-pthread); float32 matmuls will be slow")
    return _selected


def blas_info() -> BlasInfo:
    return select_blas()
