"""`isa`: every instruction set this CPU runs the C kernels in (engine/cpu/build.py), so each kernel test
runs once per ISA (avx512 and avx2 on an AVX-512 CPU)."""

from __future__ import annotations

import pytest

from engine.cpu.build import runnable_isas


@pytest.fixture(params=runnable_isas() or ["none"])
def isa(request: pytest.FixtureRequest) -> str:
    if request.param == "none":
        pytest.skip("no kernel instruction set runs on this CPU")
    return request.param
