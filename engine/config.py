"""Engine configuration, validated at start-up. `EngineOptions` holds the options `specserve serve` exposes
(its settings and flags are built from them); `read_config_file` reads `--config FILE.yaml`."""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine import envs
from specserve_configs import server_configs


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
    """`--kv-cache-memory`: bytes ("2GiB", "500MB", 1073741824) or a fraction (0 < f <= 1) of available
    memory -> (bytes, fraction), exactly one set."""
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


@dataclass(frozen=True)
class Flag:
    """How a settings field is spelled as a `specserve serve` flag where its type does not say it."""

    metavar: str | None = None  # "JSON": the text is parsed as JSON before validation
    negatable: bool = False  # a boolean that also has vLLM's `--no-x` spelling
    text: bool = False  # passed on as text for the validator (sizes with units)
    hidden: bool = False  # no flag: a --config key and keyword only (test options)


class EngineOptions(BaseModel):
    """The engine's options `specserve serve` exposes; descriptions are the flags' help."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = Field(
        None, description="HF folder, GGUF file or Hub id (default: SmolLM2-135M-Instruct)")
    revision: str | None = Field(None, description="Hub revision of the model")
    dtype: DType = Field(
        "auto", description="weight precision (auto: as stored, quantized checkpoints stay quantized; "
                            "float32: dequantized, the exactness reference); the CPU computes in float32")
    quantization: Quantization | None = Field(
        None, description="quantize a float checkpoint's weights at load (MLX affine, group 64)")
    activation_precision: Literal["auto", "int8", "float32"] = Field(
        "auto", description="activations of 4-bit products: int8 (auto: where the C kernels are AVX2, "
                            "on which int8 is the faster) or float32 (the exact-float reference)")
    max_model_len: int | None = Field(
        None, ge=16, description="context length (default: the model's, at most 32768)")
    max_num_seqs: int = Field(64, ge=1, description="most requests running at once")
    max_num_batched_tokens: int = Field(512, ge=1, description="token budget of one engine step")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV cache block (a power of two)")
    kv_cache_memory: Annotated[str | float | int, Flag(metavar="SIZE")] = Field(
        0.1, description="KV cache size: bytes (2GiB, 512MiB) or a fraction of available memory")
    enable_prefix_caching: Annotated[bool, Flag(negatable=True)] = Field(
        True, description="reuse KV blocks of shared prompt prefixes")
    attention_backend: Literal["auto", "metal", "cpu", "reference"] = Field(
        "auto", description="paged attention: Metal kernels (Apple GPUs), the C kernel (CPUs with AVX2, "
                            "AVX-512 or NEON), the MLX reference path, or auto (the first that runs here)")
    kv_layout: Literal["auto", "block", "head"] = Field(
        "auto", description="KV cache layout: head-major (auto on CPUs) or block-major (what the Metal "
                            "kernels read)")
    # Test-only (engine/faults.py): fault kind -> trigger token id.
    fault_injection: Annotated[dict[str, int] | None, Flag(hidden=True)] = Field(
        None, description="test-only fault injection")
    seed: int | None = Field(None, description="seed of the sampling key stream for unseeded requests")
    # The engine takes template text; the server reads a FILE into it.
    chat_template: Annotated[str | None, Flag(metavar="FILE")] = Field(
        None, description="chat template FILE (or inline Jinja text) overriding the model's")
    trust_remote_code: bool = Field(
        False, description="accepted for vLLM compatibility (no remote code is run)")
    # Above 1 the process must be a rank MLX's launcher started.
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks the model's layers are split over (mx.distributed, ring backend); "
                             "this machine's ranks are started here, others with --hostfile")
    # A parsed speculative config, or JSON text / a mapping for EngineConfig to parse.
    speculative_config: Annotated[Any, Flag(metavar="JSON")] = Field(
        None, description="speculative decoding config as JSON, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}'")

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_memory(cls, v: str | float | int) -> str | float | int:
        parse_memory(v)
        return v


class EngineConfig(EngineOptions):
    show_progress: bool = True

    @field_validator("speculative_config")
    @classmethod
    def _parse_spec(cls, v: Any) -> Any:
        from engine.spec.config import parse_speculative_config  # imports MLX: after platform.setup()

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


def _config_file(name: str) -> Path:
    """--config's file: a path, else a shipped config by name (`mtp` or `mtp.yaml`)."""
    path = Path(name).expanduser()
    shipped = server_configs()
    if not path.exists() and path.name == name and path.stem in shipped and path.suffix in ("", ".yaml"):
        return shipped[path.stem]
    return path


def read_config_file(name: str, known: Collection[str] | None = None) -> dict[str, Any]:
    """A --config YAML file as {field name: value}, keys spelled as flags or fields; with `known`, any other
    key is an error. Raises ValueError."""
    import yaml  # only --config files are YAML: `import engine.config` stays light

    path = _config_file(name)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        missing = isinstance(e, FileNotFoundError)
        hint = f" (shipped configs: {', '.join(server_configs())})" if missing else ""
        raise ValueError(f"--config {path}: {e.strerror}{hint}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    out = {}
    for key, value in data.items():
        key_name = str(key).strip().lstrip("-").replace("-", "_")
        if known is not None and key_name not in known:
            raise ValueError(f"--config {path}: unknown key {key!r}")
        out[key_name] = value
    _paths_from(path.parent, out)
    return out


def _paths_from(folder: Path, values: dict[str, Any]) -> None:
    """A relative path is taken from the config file's folder where the file exists there (the shipped MTP
    config names its assistant so), else it stays as written."""
    spec = values.get("speculative_config")
    slots = [(values, "model"), (values, "chat_template")]
    if values.get("generation_config") not in ("auto", "vllm"):
        slots.append((values, "generation_config"))
    if isinstance(spec, dict):
        slots.append((spec, "model"))
    for where, key in slots:
        value = where.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            beside = folder / value
            if beside.exists():
                where[key] = str(beside.resolve())
