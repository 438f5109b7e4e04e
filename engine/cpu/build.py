"""Compile the engine's C kernels (engine/cpu/*.c) with the system C compiler for the ISA `SPECSERVE_CPU_ISA`
names, once per (source, compiler, flags, CPU), into the cache folder (docs/cpu-backend.md); a cached
library is loaded only where nobody else could have written it (docs/security.md)."""

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

from engine import envs
from engine.config import cache_dir

logger = logging.getLogger(__name__)

# -ffp-contract=off: no compiler fuses scalar code its own way (the same bits on every ISA).
# -Werror=undef: a name #if cannot see is an error, not a silent 0 that picks another ISA's tiles.
BASE_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", "-Werror=undef"]
# Hardening that costs these kernels nothing measurable (tools/bench_small_gemm.py).
HARDENING_FLAGS = ["-fstack-protector-strong", "-D_FORTIFY_SOURCE=2"]
_LINUX_HARDENING = ["-Wl,-z,relro,-z,now"]
# Extensions `-march=native` could enable from CPUID although /proc/cpuinfo masks them: each one the CPU
# does not report is switched off (-mno-avx512f switches off every AVX-512 subset).
_GUARDED = {"avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f"}
# Instruction sets, best first: the CPU features each needs (/proc/cpuinfo names on x86).
ISA_FEATURES: dict[str, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512bw", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "neon": (),
}
_X86_ISAS = ("avx512", "avx2")


def machine() -> str:
    """x86_64 or arm64 (others as platform.machine() names them)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "aarch64": "arm64"}.get(m, m)


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo, or sysctl on macOS, lower-cased); empty without either."""
    for line in _cpuinfo().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
                                 capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return frozenset()
        return frozenset(f.lower().replace(".", "_") for f in out.split())
    return frozenset()


def missing_features(required: Iterable[str], flags: frozenset[str] | None = None) -> list[str]:
    """The features of `required` that the CPU (or the given flag set) does not report."""
    have = cpu_flags() if flags is None else flags
    return [f for f in required if f not in have]


def isa_reason(isa: str, flags: frozenset[str] | None = None, arch: str | None = None) -> str | None:
    """Why kernels for `isa` cannot run on this CPU (None: they can)."""
    arch = arch or machine()
    if isa == "neon":
        return None if arch == "arm64" else f"neon needs an ARM64 CPU (this is {arch})"
    if isa not in _X86_ISAS:
        return f"unknown instruction set {isa!r}"
    if arch != "x86_64":
        return f"{isa} needs an x86-64 CPU (this is {arch})"
    missing = missing_features(ISA_FEATURES[isa], flags)
    if missing:
        return f"the CPU does not report {', '.join(missing)} (/proc/cpuinfo flags)"
    return None


def runnable_isas(flags: frozenset[str] | None = None, arch: str | None = None) -> list[str]:
    """Every instruction set this CPU can run the kernels in, best first."""
    return [isa for isa in ISA_FEATURES if isa_reason(isa, flags, arch) is None]


def selected_isa() -> str | None:
    """The ISA the kernels are built for (None: off, or none runs here); a forced one the CPU cannot run is
    an error."""
    return _resolve_isa(envs.get("SPECSERVE_CPU_ISA"), cpu_flags(), machine())


@functools.cache
def _resolve_isa(choice: str, flags: frozenset[str], arch: str) -> str | None:  # asked every step
    if choice == "off":
        return None
    if choice == "auto":
        isas = runnable_isas(flags, arch)
        return isas[0] if isas else None
    why = isa_reason(choice, flags, arch)
    if why:
        raise ValueError(f"SPECSERVE_CPU_ISA={choice}: {why}")
    return choice


def _off_reason() -> str | None:
    """Why no ISA is selected (None: one is)."""
    try:
        if selected_isa() is not None:
            return None
    except ValueError as e:
        return str(e)
    if envs.get("SPECSERVE_CPU_ISA") == "off":
        return "SPECSERVE_CPU_ISA=off"
    return f"no kernel instruction set runs on this {machine()} CPU: AVX2 + FMA + F16C, AVX-512 or NEON"


def isa_status() -> str:
    """The start-up line: the ISA in use, or why the kernels are off."""
    why = _off_reason()
    return f"off ({why})" if why else str(selected_isa())


def kernel_reason(isa: str | None = None) -> str | None:
    """Why the C kernels cannot run here (None: they can): no ISA, or not Linux/macOS."""
    if sys.platform not in ("linux", "darwin"):
        return f"Linux and macOS only (this is {sys.platform})"
    return None if isa is not None else _off_reason()


def isa_flags(isa: str, flags: frozenset[str] | None = None) -> list[str]:
    """Compiler flags for kernels in `isa` on this CPU (tuned for it: -march/-mcpu=native)."""
    define = [f"-DSS_ISA_{isa.upper()}"]
    # Apple's clang has no OpenMP: the kernels then run on one thread (simd.h's stand-ins).
    base = BASE_FLAGS if sys.platform == "linux" else [f for f in BASE_FLAGS if f != "-fopenmp"]
    link = _LINUX_HARDENING if sys.platform == "linux" else []
    if isa == "neon":
        tune = ["-mcpu=native"] if sys.platform == "linux" else ["-mcpu=apple-m1"]
        return [*base, *tune, *define, *HARDENING_FLAGS, *link]
    have = cpu_flags() if flags is None else flags
    need = ISA_FEATURES[isa]
    enable = [f"-m{_GUARDED.get(f, f)}" for f in need]
    # Features the CPU lacks, and AVX-512 for a lower ISA forced on an AVX-512 CPU.
    disable = [f"-mno-{opt}" for f, opt in _GUARDED.items()
               if f not in have or (f == "avx512f" and isa != "avx512")]
    return [*base, "-march=native", *define, *enable, *disable, *HARDENING_FLAGS, *link]


def cpu_kernel_reason(load: Callable[[], object], source: str, isa: str | None = None) -> str | None:
    """Why a C kernel run between MLX graphs cannot run here (None: it can): no ISA, MLX on a GPU, or
    `load()` failing."""
    import mlx.core as mx  # engine/blas.py imports this module before MLX may load

    why = kernel_reason(isa)
    if why:
        return why
    if mx.metal.is_available() or mx.default_device() != mx.cpu:
        return "MLX runs on a GPU"
    try:
        load()
    except (RuntimeError, OSError) as e:
        return f"could not build {source}: {e}"
    return None


def build_kernel(source: Path, name: str, isa: str | None = None, out_dir: Path | None = None) -> Path:
    """Build one kernel source (with simd.h and its #includes) for `isa` (default: the selected one);
    -> the library's path. Raises RuntimeError where no ISA runs."""
    isa = isa or selected_isa()
    if isa is None:
        raise RuntimeError(f"no C kernels here: {isa_status()}")
    return build_library(source, f"{name}-{isa}", isa_flags(isa), out_dir, includes=included_files(source))


def included_files(source: Path) -> list[Path]:
    """simd.h and the kernel files `source` #includes, directly or through another (part of its version)."""
    here = source.parent
    files = [p for p in [*here.glob("*.c"), *here.glob("*.h")] if p != source]
    found: set[Path] = set()
    todo = [source]
    while todo:
        text = todo.pop().read_text()
        for p in files:
            if p not in found and f'#include "{p.name}"' in text:
                found.add(p)
                todo.append(p)
    simd = here / "simd.h"
    return [simd, *sorted(found - {simd})]


def _cpu_fingerprint() -> str:
    info = _cpuinfo()
    if not info:
        return platform.processor()
    keys = ("model name", "flags")
    return "|".join(sorted({line.strip() for line in info.splitlines() if line.startswith(keys)}))


def unsafe_reason(path: Path, root: Path) -> str | None:
    """Why `path` (a library or its folder) must not be trusted: it or a folder up to `root` is not this
    user's (or root's), is group/other-writable, or `path` is a symlink. None: safe."""
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
    """Compile `source` unless this version is built; -> the library's path. `includes`: files it
    #includes (part of its version). Raises RuntimeError without a compiler or on a failed build."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = source.read_bytes() + b"".join(p.read_bytes() for p in includes)
    # -march=native: machines with other CPUs sharing the cache must not reuse the build.
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
    # A private name, then rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                             timeout=240)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
