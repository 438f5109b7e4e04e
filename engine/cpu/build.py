"""Compile the engine's small C libraries (engine/cpu/gemm.c, engine/cpu/attention.c,
engine/cpu/mtp.c) where they run.

Each is built once per (source, compiler, flags, CPU) with the system C compiler into the model cache
folder, and loaded with ctypes. Only for the instruction-set features the CPU reports: a kernel whose
features are missing is not built (its caller falls back), and the compiler is told not to use the
vector extensions the CPU lacks. A library is loaded from the cache only when it and every folder up
to the cache root belong to this user (or root) and nobody else can write them; otherwise it is built
again in a private temporary folder.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from engine.config import cache_dir

logger = logging.getLogger(__name__)

# Built where it runs, so tuned for this CPU (the small GEMM is faster than with generic AVX-512 flags).
BASE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
# Hardening that costs these kernels nothing (no stack arrays in the hot loops, a few external calls
# per kernel call); tools/bench_small_gemm.py shows it.
HARDENING_FLAGS = ["-fstack-protector-strong", "-D_FORTIFY_SOURCE=2", "-Wl,-z,relro,-z,now"]
# Vector extensions `-march=native` could enable from CPUID although the kernel (or a hypervisor) masks
# them in /proc/cpuinfo: each one the CPU does not report is switched off (gcc/clang option names).
# -mno-avx512f also switches off every other AVX-512 subset.
_GUARDED = {"avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f"}


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


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo reports (empty where there is none)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (False where there is no /proc/cpuinfo)."""
    return flag in cpu_flags()


def missing_features(required: Iterable[str], flags: frozenset[str] | None = None) -> list[str]:
    """The features of `required` that the CPU (or the given flag set) does not report."""
    have = cpu_flags() if flags is None else flags
    return [f for f in required if f not in have]


def feature_reason(required: Iterable[str], flags: frozenset[str] | None = None) -> str | None:
    """Why a kernel needing `required` cannot be built here (None: it can)."""
    missing = missing_features(required, flags)
    if missing:
        return f"the CPU does not report {', '.join(missing)} (/proc/cpuinfo flags)"
    return None


def compile_flags(required: Iterable[str], flags: frozenset[str] | None = None) -> list[str]:
    """Compiler flags for a kernel that needs the CPU features `required` (cpuinfo names, e.g.
    "avx512f"); raises RuntimeError when the CPU lacks one of them."""
    required = list(required)
    why = feature_reason(required, flags)
    if why:
        raise RuntimeError(why)
    have = cpu_flags() if flags is None else flags
    enable = [f"-m{_GUARDED.get(f, f)}" for f in required]
    disable = [f"-mno-{opt}" for f, opt in _GUARDED.items() if f not in have]
    return [*BASE_FLAGS, *enable, *disable, *HARDENING_FLAGS]


def cpu_kernel_reason(features: Iterable[str], load: Callable[[], object], source: str) -> str | None:
    """Why a C kernel that runs between MLX graphs on the CPU cannot run here (None: it can): not x86-64
    Linux, a CPU feature missing, MLX on a GPU, or `load()` (build and load the library) failing."""
    import mlx.core as mx

    why = x86_linux_reason() or feature_reason(features)
    if why:
        return why
    if mx.metal.is_available() or mx.default_device() != mx.cpu:
        return "MLX runs on a GPU"
    try:
        load()
    except (RuntimeError, OSError) as e:
        return f"could not build {source}: {e}"
    return None


def _cpu_fingerprint() -> str:
    info = _cpuinfo()
    if not info:
        return platform.processor()
    keys = ("model name", "flags")
    return "|".join(sorted({line.strip() for line in info.splitlines() if line.startswith(keys)}))


def unsafe_reason(path: Path, root: Path) -> str | None:
    """Why `path` (a built library, or the folder for one) must not be trusted: it, or a folder above it
    up to `root`, is not owned by this user (or root) or is writable by group or others, or `path` is a
    symbolic link. None: safe."""
    me = os.geteuid()
    for item in [path, *[p for p in path.parents if p == root or root in p.parents]]:
        try:
            st = os.lstat(item) if item == path else os.stat(item)
        except OSError as e:
            return f"cannot stat {item}: {e}"
        if stat.S_ISLNK(st.st_mode):
            return f"{item} is a symbolic link"
        if st.st_uid not in (me, 0):
            return f"{item} is owned by uid {st.st_uid}, not by this user (uid {me})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{item} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_dirs(root: Path, folder: Path) -> None:
    """Create `folder` (inside `root`) and any missing folder between them with mode 0700."""
    root.parent.mkdir(parents=True, exist_ok=True)
    for d in [*reversed([p for p in folder.parents if p == root or root in p.parents]), folder]:
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)


@functools.cache
def _fallback_dir() -> Path:
    """A fresh folder only this process's user can write, removed at exit."""
    d = Path(tempfile.mkdtemp(prefix="specserve-kernels-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


def build_library(source: Path, name: str, flags: list[str], out_dir: Path | None = None,
                  includes: Iterable[Path] = ()) -> Path:
    """Compile `source` if this version is not built yet; returns the library's path. `includes`: the
    files `source` #includes, part of its version. Raises RuntimeError when no compiler is found or
    compilation fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = source.read_bytes() + b"".join(p.read_bytes() for p in includes)
    # -march=native: a cache folder shared by machines with other CPUs must not reuse the build.
    tag = hashlib.sha256(src + " ".join([cc, *flags, _cpu_fingerprint()]).encode()).hexdigest()[:16]
    root = out_dir or cache_dir()
    folder = out_dir or cache_dir() / "kernels"
    out = folder / f"{name}-{tag}.so"
    if out.exists():
        why = unsafe_reason(out, root)
        if why is None:
            return out
        refused = f"not loading the cached {out}"
    else:
        _private_dirs(root, folder)
        why = unsafe_reason(folder, root)
        refused = f"not building {name} in {folder}"
    if why is not None:
        logger.warning("%s: %s; building it in a private folder instead", refused, why)
        out = _fallback_dir() / out.name
        if out.exists():
            return out
    # Build to a private name and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
