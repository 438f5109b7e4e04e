"""Build and load `small_gemm.c`, a small-M float32 GEMM placed in front of the optimized BLAS.

MLX's CPU backend calls `cblas_sgemm` for every float32 matmul. Decode and draft verification run
matmuls with a few rows of activations (1 + K per verifying request, one per decoding request), where
MKL's GEMM path costs ~1.8x its GEMV path from 4 rows on; the kernel here streams the weights once for
up to 8 rows (up to 16 in two passes over cached weight tiles), and gives each row bitwise the result it
would have alone (see the C file). It is compiled once per source version with the system C compiler
(`cc`, AVX-512F, OpenMP) into the model cache folder, and must be loaded before libmlx binds
`cblas_sgemm` (engine/blas.py does this). `SPECSERVE_SMALL_GEMM=0` turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.config import cache_dir

SOURCE = Path(__file__).with_name("small_gemm.c")
MAX_M = 16
# Built where it runs, so tuned for this CPU (measured ~10% faster at 3-5 rows than generic AVX-512).
_FLAGS = ["-O3", "-march=native", "-mavx512f", "-mfma", "-fopenmp", "-fPIC", "-shared"]

def unsupported_reason() -> str | None:
    """Why the kernel cannot be used on this machine (None: it can)."""
    if os.environ.get("SPECSERVE_SMALL_GEMM", "auto").strip().lower() in ("0", "off", "false", "no"):
        return "SPECSERVE_SMALL_GEMM=0"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"x86-64 Linux only (this is {sys.platform}/{platform.machine()})"
    return None


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keys = ("model name", "flags")
    return "|".join(sorted({line.strip() for line in info.splitlines() if line.startswith(keys)}))


def build(out_dir: Path | None = None) -> Path:
    """Compile the library if this source version is not built yet; returns its path.
    Raises RuntimeError when no compiler is found or compilation fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = SOURCE.read_bytes()
    # -march=native: a cache folder shared by machines with other CPUs must not reuse the build.
    tag = hashlib.sha256(src + " ".join([cc, *_FLAGS, _cpu_fingerprint()]).encode()).hexdigest()[:16]
    out = (out_dir or cache_dir() / "kernels") / f"small_gemm-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build to a private name and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *_FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load_before(blas: ctypes.CDLL) -> int:
    """Load the kernel with RTLD_GLOBAL, forwarding every call it does not handle to `blas`
    (already loaded, RTLD_LOCAL). Call before the BLAS is made global and before libmlx loads.
    Returns the largest row count it handles (0: the CPU lacks AVX-512F, all calls forwarded)."""
    lib = ctypes.CDLL(str(build()), mode=ctypes.RTLD_GLOBAL)
    lib.small_gemm_init.restype = ctypes.c_int
    lib.small_gemm_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return int(lib.small_gemm_init(ctypes.cast(blas.cblas_sgemm, ctypes.c_void_p), MAX_M))
