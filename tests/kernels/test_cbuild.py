"""engine/cpu/build.py: the kernels' instruction set follows the CPU's features and SPECSERVE_CPU_ISA, the
compiler is told exactly that ISA, the kernels report themselves unavailable (and their callers fall back)
where no ISA runs, and a cached library is loaded only from folders nobody else can write."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.attention.reference import paged_attention_reference
from engine.attention.selector import select_attention
from engine.cpu import attention as cpu_attention
from engine.cpu import build as cbuild
from engine.cpu import gemm as small_gemm

AVX2_HOST = frozenset(["sse", "sse2", "avx", "avx2", "fma", "f16c"])
AVX512_HOST = AVX2_HOST | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
OLD_HOST = frozenset(["sse", "sse2", "avx"])  # x86-64 without AVX2 + FMA + F16C


def test_isas_follow_the_reported_features() -> None:
    assert cbuild.runnable_isas(AVX512_HOST, "x86_64") == ["avx512", "avx2"]
    assert cbuild.runnable_isas(AVX2_HOST, "x86_64") == ["avx2"]
    assert cbuild.runnable_isas(AVX2_HOST - {"f16c"}, "x86_64") == []
    assert cbuild.runnable_isas(frozenset(["fp", "asimd"]), "arm64") == ["neon"]
    assert "avx512f" in (cbuild.isa_reason("avx512", AVX2_HOST, "x86_64") or "")
    assert "ARM64" in (cbuild.isa_reason("neon", AVX512_HOST, "x86_64") or "")


def test_compile_flags_follow_the_isa_and_the_cpu() -> None:
    flags = cbuild.isa_flags("avx512", AVX512_HOST)
    assert {"-mavx512f", "-DSS_ISA_AVX512", "-ffp-contract=off"} <= set(flags) and "-mno-avx512f" not in flags
    # AVX2 forced on an AVX-512 CPU: -march=native is told not to use AVX-512.
    flags = cbuild.isa_flags("avx2", AVX512_HOST)
    assert {"-mavx2", "-mfma", "-mf16c", "-mno-avx512f", "-DSS_ISA_AVX2", "-ffp-contract=off"} <= set(flags)
    assert "-mavx512f" not in flags
    flags = cbuild.isa_flags("avx2", AVX2_HOST)
    assert "-mno-avx512f" in flags and "-mno-avx2" not in flags and "-mno-fma" not in flags


def test_selection_auto_forced_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cbuild, "cpu_flags", lambda: AVX512_HOST)
    monkeypatch.setattr(cbuild, "machine", lambda: "x86_64")
    for value, want in (("auto", "avx512"), ("avx2", "avx2"), ("avx512", "avx512"), ("off", None)):
        monkeypatch.setenv("SPECSERVE_CPU_ISA", value)
        assert cbuild.selected_isa() == want
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "off")
    assert cbuild.isa_status() == "off (SPECSERVE_CPU_ISA=off)"
    monkeypatch.setattr(cbuild, "cpu_flags", lambda: AVX2_HOST)
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="avx512f"):
        cbuild.selected_isa()
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "sse")
    with pytest.raises(ValueError, match="expected one of"):
        cbuild.selected_isa()


def test_kernels_are_unavailable_on_a_cpu_without_a_kernel_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    """An x86-64 CPU without AVX2 + FMA + F16C: no kernel is built, each reports why, and the attention
    selector falls back to the reference path (an explicit `cpu` backend is refused)."""
    from engine.cpu import eagle3 as eagle3_cpu
    from engine.cpu import mtp as mtp_cpu

    monkeypatch.setattr(cbuild, "cpu_flags", lambda: OLD_HOST)
    monkeypatch.setattr(cbuild, "machine", lambda: "x86_64")
    monkeypatch.delenv("SPECSERVE_CPU_ISA", raising=False)
    for why in (small_gemm.unsupported_reason(), cpu_attention.unsupported_reason(),
                mtp_cpu.unsupported_reason(None, None, None),  # type: ignore[arg-type]
                eagle3_cpu.unsupported_reason(None)):  # type: ignore[arg-type]
        assert why is not None and "no kernel instruction set" in why
    with pytest.raises(RuntimeError, match="no kernel instruction set"):
        small_gemm.build()
    fn, label = select_attention("auto")
    assert fn is paged_attention_reference and "no kernel instruction set" in label
    with pytest.raises(ValueError, match="no kernel instruction set"):
        select_attention("cpu")


def test_off_turns_every_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "off")
    assert "SPECSERVE_CPU_ISA=off" in (small_gemm.unsupported_reason() or "")
    assert "SPECSERVE_CPU_ISA=off" in (cpu_attention.unsupported_reason() or "")


SOURCE = "int answer(void) { return %d; }\n"


@pytest.fixture
def tiny_source(tmp_path: Path) -> Path:
    src = tmp_path / "answer.c"
    src.write_text(SOURCE % 42)
    return src


def _answer(path: Path) -> int:
    return ctypes.CDLL(str(path)).answer()


def _plant(lib: Path, tmp_path: Path) -> None:
    """Replace the cached library with another one (what an attacker who can write there would do)."""
    evil = tmp_path / "evil.c"
    evil.write_text(SOURCE % 666)
    subprocess.run(["cc", "-shared", "-fPIC", str(evil), "-o", str(lib)], check=True)


def _chmod(mode: int) -> Callable[[Path, Path], None]:
    return lambda lib, folder: os.chmod(folder, mode)


def _chown_lib(lib: Path, folder: Path) -> None:
    os.chown(lib, 65534, 65534)


def _chown_folder(lib: Path, folder: Path) -> None:
    os.chown(folder, 65534, 65534)


def _group_writable_lib(lib: Path, folder: Path) -> None:
    os.chmod(lib, 0o775)


def _symlink(lib: Path, folder: Path) -> None:
    real = folder.parent / "elsewhere.so"
    shutil.move(lib, real)
    lib.symlink_to(real)


UNSAFE = {
    "world-writable folder": (_chmod(0o777), "writable by group or others"),
    "group-writable folder": (_chmod(0o770), "writable by group or others"),
    "group-writable library": (_group_writable_lib, "writable by group or others"),
    "library owned by another user": (_chown_lib, "owned by uid 65534"),
    "folder owned by another user": (_chown_folder, "owned by uid 65534"),
    "library is a symlink": (_symlink, "symbolic link"),
}


@pytest.mark.parametrize("case", list(UNSAFE))
def test_cached_library_in_an_unsafe_place_is_refused(case: str, tiny_source: Path, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    corrupt, reason = UNSAFE[case]
    if "owned by" in case and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    folder = tmp_path / "cache"
    flags = ["-O2", "-fPIC", "-shared"]
    lib = cbuild.build_library(tiny_source, "answer", flags, folder)
    assert lib.parent == folder and _answer(lib) == 42
    assert cbuild.build_library(tiny_source, "answer", flags, folder) == lib  # safe: reused as it is
    _plant(lib, tmp_path)
    corrupt(lib, folder)
    with caplog.at_level(logging.WARNING, logger="engine.cpu.build"):
        again = cbuild.build_library(tiny_source, "answer", flags, folder)
    assert again != lib and folder not in again.parents
    assert _answer(again) == 42  # rebuilt from source, the planted library never loaded
    st = os.stat(again.parent)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert any(reason in r.getMessage() and "not loading" in r.getMessage() for r in caplog.records)


def test_unsafe_cache_root_is_refused_before_building(tiny_source: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The cache folders are created 0700; a cache root that others can write is not built into."""
    root = tmp_path / "specserve-cache"
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(root))
    lib = cbuild.build_library(tiny_source, "answer", ["-fPIC", "-shared"])
    assert lib.parent == root / "kernels"
    for d in (root, root / "kernels"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    shutil.rmtree(root / "kernels")
    os.chmod(root, 0o777)  # the parent of the kernels folder, inside the cache root
    with caplog.at_level(logging.WARNING, logger="engine.cpu.build"):
        other = cbuild.build_library(tiny_source, "answer", ["-fPIC", "-shared"])
    assert root not in other.parents and _answer(other) == 42
    assert any("writable by group or others" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
def test_built_kernels_are_hardened() -> None:
    """Full RELRO (read-only relocations, symbols bound at load) and the stack protector in the
    library the engine builds."""
    if cpu_attention.unsupported_reason() is not None:
        pytest.skip(f"C attention unavailable here: {cpu_attention.unsupported_reason()}")
    lib = cbuild.build_kernel(cpu_attention.SOURCE, "cpu_attention")
    dyn = subprocess.run(["readelf", "-d", "-W", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "BIND_NOW" in dyn
    segments = subprocess.run(["readelf", "-l", "-W", str(lib)], capture_output=True, text=True,
                              check=True).stdout
    assert "GNU_RELRO" in segments


def test_an_edited_include_rebuilds_the_library(tmp_path: Path) -> None:
    """engine/cpu/layers.c #includes qgemm.c and attention.c: editing an included file must give a new
    build, not the cached library of the old code."""
    inc = tmp_path / "value.h"
    src = tmp_path / "main.c"
    src.write_text('#include "value.h"\nint answer(void) { return VALUE; }\n')
    inc.write_text("#define VALUE 1\n")
    first = cbuild.build_library(src, "inc", ["-shared", "-fPIC"], tmp_path / "out", includes=[inc])
    assert _answer(first) == 1
    inc.write_text("#define VALUE 2\n")
    second = cbuild.build_library(src, "inc", ["-shared", "-fPIC"], tmp_path / "out", includes=[inc])
    assert second != first and _answer(second) == 2


def test_register_tiles_follow_the_isa(isa: str) -> None:
    """Each build sizes its register tiles to its own vector registers: 32 zmm take 4 weight rows at once
    (4-bit and float32 NT products), 16 ymm or NEON's logical vectors fewer. (A register count #if could not
    see once gave AVX-512 the AVX2 tiles: the same bits at half the speed.)"""
    if isa == "none":
        pytest.skip("no kernel ISA runs here")
    from engine.cpu import qgemm

    q = qgemm._lib(isa)
    gemm = ctypes.CDLL(str(small_gemm.build(isa)))  # local symbols: the engine's BLAS hook stays as it is
    q4, f32 = 4, 5  # qgemm.c's FMT_Q4, FMT_F32
    wide = 4 if isa == "avx512" else 2
    assert gemm.small_gemm_wide_rows() == wide
    assert [q.qgemm_tile_rows(q4, m) for m in (1, 6, 7, 12, 13)] == \
        ([4, 4, 2, 2, 0] if isa == "avx512" else [1, 1, 0, 0, 0])
    assert q.qgemm_tile_rows(f32, 1) == (4 if isa == "avx512" else 2)
