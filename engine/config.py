"""Engine configuration. Validated at start-up so that bad settings fail before any work is done."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine import envs


def cache_dir() -> Path:
    """Where specserve keeps converted models and built kernels (`SPECSERVE_CACHE_DIR`)."""
    root = envs.get("SPECSERVE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "specserve"


DType = Literal["auto", "float32", "float16", "bfloat16"]
Quantization = Literal["q8", "q4"]

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30,
          "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_memory(value: str | int | float) -> tuple[int | None, float | None]:
    """`--kv-cache-memory`: bytes ("2GiB", "500MB", 1073741824) or a fraction of available memory
    (0 < f <= 1). Returns (bytes, fraction) with exactly one set."""
    if isinstance(value, bool):
        raise ValueError("kv_cache_memory must be a size or a fraction")
    if isinstance(value, (int, float)):
        num, unit = float(value), ""
    else:
        m = _SIZE_RE.match(value)
        if not m:
            raise ValueError(f"kv_cache_memory: cannot parse {value!r} (examples: 2GiB, 512MB, 0.2)")
        num, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "" and 0 < num <= 1:
        return None, num
    if unit not in _UNITS:
        raise ValueError(f"kv_cache_memory: unknown unit in {value!r}")
    nbytes = int(num * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return nbytes, None


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 2**30


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = Field(None, description="HF folder, GGUF file, Hub id; None: default model")
    revision: str | None = None
    dtype: DType = "auto"
    # Quantize a float checkpoint at load with MLX's affine quantizer (group 64); None: as stored.
    quantization: Quantization | None = None
    # 4-bit weights multiplied with 8-bit activations (int8; auto: on AVX2 kernels, where they are faster)
    # or float32 ones (the exact-float reference).
    activation_precision: Literal["auto", "int8", "float32"] = "auto"
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_memory: str | float | int = Field(
        0.1, description="bytes ('2GiB') or fraction of available memory")
    enable_prefix_caching: bool = True
    # Paged attention: Metal kernels where MLX has an Apple GPU, the C kernel on AVX-512 CPUs, else the
    # MLX gather + attention path.
    attention_backend: Literal["auto", "metal", "cpu", "reference"] = "auto"
    # Paged KV tensors: head-major (the CPU default) or block-major (what the Metal kernels read).
    kv_layout: Literal["auto", "block", "head"] = "auto"
    # Test-only fault injection (engine/faults.py): fault kind -> trigger token id.
    fault_injection: dict[str, int] | None = None
    seed: int | None = None
    chat_template: str | None = None  # template text, overriding the model's
    trust_remote_code: bool = False
    show_progress: bool = True
    # Ranks the layers are split over (engine/distributed.py); above 1 the process must be one of the
    # ranks MLX's launcher started.
    tensor_parallel_size: int = Field(1, ge=1)
    # A parsed speculative config (engine.spec.config), or JSON text / a mapping to parse.
    speculative_config: Any = None

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_memory(cls, v: str | float | int) -> str | float | int:
        parse_memory(v)
        return v

    @field_validator("speculative_config")
    @classmethod
    def _parse_spec(cls, v: Any) -> Any:
        from engine.spec.config import parse_speculative_config

        return v if v is None or hasattr(v, "method") else parse_speculative_config(v)

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("block_size must be a power of two")
        return v

    def kv_cache_bytes(self) -> int:
        nbytes, frac = parse_memory(self.kv_cache_memory)
        if nbytes is not None:
            return nbytes
        assert frac is not None
        return int(available_memory_bytes() * frac)
