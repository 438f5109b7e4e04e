"""The one registry of environment variables specserve reads: name, default, allowed values, meaning. Only
process-wide choices made before MLX loads, and deployment settings, live here; read them with `get`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: str
    meaning: str
    choices: tuple[str, ...] | None = None  # None: free text (a path, a key)


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("SPECSERVE_CACHE_DIR", "", "where converted models and built C kernels are kept "
           "(default: ~/.cache/specserve)"),
    EnvVar("SPECSERVE_API_KEY", "", "the API key `specserve serve` requires when --api-key is not given"),
    EnvVar("SPECSERVE_BLAS", "auto", "the BLAS behind MLX's float32 matmuls on Linux: auto, mkl, openblas, "
           "reference, or the path of a library exporting plain cblas_* symbols"),
    EnvVar("SPECSERVE_SMALL_GEMM", "on", "the small-M GEMM kernel in front of the BLAS (x86-64 Linux)",
           ("on", "off")),
    EnvVar("SPECSERVE_CPU_ISA", "auto", "the instruction set the C kernels are built for: auto (the best "
           "the CPU reports), avx512, avx2, neon, or off (no C kernels: MLX's float32 path)",
           ("auto", "avx512", "avx2", "neon", "off")),
    EnvVar("SPECSERVE_CPU_LAYERS", "on", "llama-family decoder layers in one C call per step on the CPU "
           "(engine/cpu/layers.c); off: the MLX modules", ("on", "off")),
    EnvVar("SPECSERVE_TP_BACKEND", "any", "the mx.distributed backend a tensor-parallel rank joins (set by "
           "`serve --tensor-parallel-size` from the hostfile; any: the first that starts)",
           ("any", "ring", "mpi", "jaccl", "nccl")),
    EnvVar("SPECSERVE_MALLOC", "tuned", "glibc malloc: one arena with fixed thresholds (tuned) or glibc's "
           "own behaviour (default)", ("tuned", "default")),
)}


def get(name: str) -> str:
    """The variable's value (its default when unset or empty); a value outside its choices is an error."""
    var = VARIABLES[name]
    value = os.environ.get(name, "").strip() or var.default
    if var.choices is not None:
        value = value.lower()
        if value not in var.choices:
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(var.choices)}")
    return value
