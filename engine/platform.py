"""The one explicit process set-up (BLAS, malloc, OpenMP spinning, the C kernels), to run before MLX loads:
the CLI and `LLM(...)` call `setup()`, as must a program that imports MLX itself (docs/architecture.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.blas import BlasInfo, select_blas
from engine.malloc import tune_malloc


@dataclass(frozen=True, slots=True)
class PlatformInfo:
    blas: BlasInfo
    malloc: str


_info: PlatformInfo | None = None


def setup() -> PlatformInfo:
    """Make the process-wide choices once (later calls return the first result)."""
    global _info
    if _info is None:
        # Read by libgomp when it loads: workers spin through the short draft loop instead of sleeping.
        if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
            os.environ["GOMP_SPINCOUNT"] = "1000000"
        blas = select_blas()
        _info = PlatformInfo(blas, tune_malloc())
    return _info
