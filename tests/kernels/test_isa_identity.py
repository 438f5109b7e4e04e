"""The same bits on every instruction set: tests/kernels/isa_harness.c runs every C kernel (small GEMM, each
weight format and group size, attention at head sizes 32-256 with and without a window, two decoder
layers per weight format, the MTP pass, the EAGLE-3 draft loop) on inputs it generates itself, checks batch
invariance (every row count 1..256 natively; under qemu every tile path and chunk split), and dumps each
output. It is built for every ISA this CPU runs, and for NEON with Debian's aarch64 cross-compiler run under
qemu-user; the dumps must be bitwise equal."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.cpu import build as cbuild

ROOT = Path(__file__).parents[2]
HARNESS = Path(__file__).with_name("isa_harness.c")
SOURCES = [HARNESS, ROOT / "engine/cpu/gemm.c", ROOT / "engine/cpu/mtp.c", ROOT / "engine/cpu/eagle3.c"]
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"


def _records(path: Path) -> dict[str, bytes]:
    data, i, out = path.read_bytes(), 0, {}
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        name = data[i + 4 : i + 4 + n].decode()
        i += 4 + n
        (nb,) = struct.unpack_from("<Q", data, i)
        out[name] = data[i + 8 : i + 8 + nb]
        i += 8 + nb
    return out


def _run(cmd: list[str], what: str, timeout: int) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{what} failed ({res.returncode}): {res.stderr[-2000:]}"


def _native(isa: str, tmp: Path) -> dict[str, bytes]:
    exe, dump = tmp / f"harness-{isa}", tmp / f"{isa}.bin"
    flags = [f for f in cbuild.isa_flags(isa) if f != "-shared"]
    _run([os.environ.get("CC", "cc"), *flags, "-I", str(ROOT / "engine/cpu"), *map(str, SOURCES),
          "-o", str(exe), "-lm"], f"building the harness for {isa}", 300)
    _run([str(exe), str(dump)], f"the {isa} harness", 300)
    return _records(dump)


def _neon(tmp: Path) -> dict[str, bytes]:
    exe, dump = tmp / "harness-neon", tmp / "neon.bin"
    # The flags the engine builds NEON kernels with, for a generic ARMv8 target instead of -mcpu=native.
    _run([CROSS_CC, "-O3", "-fopenmp", "-ffp-contract=off", "-Werror=undef", "-march=armv8-a",
          "-DSS_ISA_NEON", "-static", "-I", str(ROOT / "engine/cpu"), *map(str, SOURCES), "-o", str(exe),
          "-lm"],
         "cross-compiling for NEON", 300)
    _run([QEMU, str(exe), str(dump), "quick"], "the NEON harness under qemu", 600)
    return _records(dump)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    tmp = tmp_path_factory.mktemp("isa")
    jobs: dict[str, Callable[[], dict[str, bytes]]] = {}
    if cbuild.machine() == "x86_64":
        jobs.update({isa: functools.partial(_native, isa, tmp) for isa in cbuild.runnable_isas()})
    if cbuild.machine() == "arm64":
        jobs["neon"] = functools.partial(_native, "neon", tmp)
    elif shutil.which(CROSS_CC) and shutil.which(QEMU):
        jobs["neon"] = functools.partial(_neon, tmp)
    with concurrent.futures.ThreadPoolExecutor(len(jobs) or 1) as pool:  # the builds are single-threaded
        futures = {isa: pool.submit(job) for isa, job in jobs.items()}
        return {isa: f.result() for isa, f in futures.items()}


def test_every_build_is_batch_invariant_and_names_its_isa(dumps: dict[str, dict[str, bytes]]) -> None:
    if not dumps:
        pytest.skip("no kernel ISA runs here and no NEON cross-compiler + qemu-user")
    for isa, recs in dumps.items():  # each harness exited 0: every row count gave the 256-row bits
        assert recs["isa"].decode() == isa
        assert len(recs) > 60
        assert sum(k.endswith("/int8") for k in recs) >= 15  # the 8-bit-activation products and layers
        assert sum(k.startswith("blocks/") for k in recs) == 10  # GGML's block formats: products and rows


def test_outputs_are_bitwise_equal_across_isas(dumps: dict[str, dict[str, bytes]]) -> None:
    if len(dumps) < 2:
        pytest.skip(f"one kernel build here ({', '.join(dumps) or 'none'}): install gcc-aarch64-linux-gnu "
                    "and qemu-user to compare with NEON")
    names = sorted(dumps)
    base = dumps[names[0]]
    for other in names[1:]:
        assert base.keys() == dumps[other].keys()
        diff = []
        for key in base:
            if key != "isa" and base[key] != dumps[other][key]:
                a, b = np.frombuffer(base[key], np.float32), np.frombuffer(dumps[other][key], np.float32)
                diff.append(f"{key}: {(a != b).sum()} of {a.size} differ, max {np.abs(a - b).max():.3g}")
        assert not diff, f"{names[0]} vs {other}:\n" + "\n".join(diff)


def test_the_dumps_are_not_trivial(dumps: dict[str, dict[str, bytes]]) -> None:
    """The comparison above could pass on outputs that are all zero or all NaN: they are neither."""
    if not dumps:
        pytest.skip("no kernel build here")
    recs = next(iter(dumps.values()))
    for key, data in recs.items():
        if key == "isa":
            continue
        a = np.frombuffer(data, np.float32)
        assert np.isfinite(a).all() and np.count_nonzero(a) > a.size // 2, key
