"""Compile the engine's small C libraries (engine/small_gemm.c, engine/spec/mtp_cpu.c) where they run.

Each is built once per (source, compiler, flags, CPU) with the system C compiler into the model cache
folder, and loaded with ctypes.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.config import cache_dir

# Built where it runs, so tuned for this CPU (small_gemm: ~10% faster at 3-5 rows than generic AVX-512).
X86_FLAGS = ["-O3", "-march=native", "-mavx512f", "-mfma", "-fopenmp", "-fPIC", "-shared"]


def x86_linux_reason() -> str | None:
    """Why an x86-64 Linux library cannot be used here (None: it can)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"x86-64 Linux only (this is {sys.platform}/{platform.machine()})"
    return None


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (False where there is no /proc/cpuinfo)."""
    return any(flag in line.split() for line in _cpuinfo().splitlines() if line.startswith("flags"))


def _cpu_fingerprint() -> str:
    info = _cpuinfo()
    if not info:
        return platform.processor()
    keys = ("model name", "flags")
    return "|".join(sorted({line.strip() for line in info.splitlines() if line.startswith(keys)}))


def build_library(source: Path, name: str, flags: list[str], out_dir: Path | None = None) -> Path:
    """Compile `source` if this version is not built yet; returns the library's path.
    Raises RuntimeError when no compiler is found or compilation fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = source.read_bytes()
    # -march=native: a cache folder shared by machines with other CPUs must not reuse the build.
    tag = hashlib.sha256(src + " ".join([cc, *flags, _cpu_fingerprint()]).encode()).hexdigest()[:16]
    out = (out_dir or cache_dir() / "kernels") / f"{name}-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build to a private name and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
