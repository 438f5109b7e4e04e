"""The one explicit process set-up: BLAS, malloc, OpenMP spinning and the C kernels, before MLX loads.

`import engine` changes nothing; the CLI and `LLM(...)` call `setup()`, and so must any program that
imports MLX itself and wants the optimized CPU path (call it before `import mlx`).
"""

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
        # libgomp reads this when it loads (with the GEMM kernel): its workers keep spinning between
        # target steps and the short single-threaded draft loop instead of sleeping and waking late.
        if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
            os.environ["GOMP_SPINCOUNT"] = "1000000"
        blas = select_blas()
        _info = PlatformInfo(blas, tune_malloc())
    return _info
