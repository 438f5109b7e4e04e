"""Server settings: one pydantic model fed by the CLI flags and `--config FILE.yaml` alike.

The defaults here are the single source of truth: the CLI reads them for `--help`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
UvicornLogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]

_SIZE_RE = re.compile(r"^\s*([0-9]+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30}


def parse_size(value: int | str) -> int:
    """"16MiB", "512kB", 4096 -> bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 16MiB")
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"cannot parse size {value!r} (examples: 1048576, 512KiB, 16MiB)")
    return int(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()]


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # -- model and engine (vLLM's flag names) --------------------------------------------------
    model: str | None = Field(
        None, description="HF folder, GGUF file or Hub id (default: SmolLM2-135M-Instruct)")
    served_model_name: list[str] | None = Field(
        None, description="name(s) clients may use in `model`; the first is reported "
                          "(default: the model's name)")
    revision: str | None = Field(None, description="Hub revision of the model")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="weight precision (auto: as stored, quantized checkpoints stay quantized; "
                            "float32: dequantized, the exactness reference); the CPU computes in float32")
    quantization: Literal["q8", "q4"] | None = Field(
        None, description="quantize a float checkpoint's weights at load (MLX affine, group 64)")
    activation_precision: Literal["auto", "int8", "float32"] = Field(
        "auto", description="activations of 4-bit products: int8 (auto: where the C kernels are AVX2, "
                            "on which int8 is the faster) or float32 (the exact-float reference)")
    max_model_len: int | None = Field(
        None, ge=16, description="context length (default: the model's, at most 32768)")
    max_num_seqs: int = Field(64, ge=1, description="most requests running at once")
    max_num_batched_tokens: int = Field(512, ge=1, description="token budget of one engine step")
    block_size: int = Field(16, ge=1, description="tokens per KV cache block (a power of two)")
    kv_cache_memory: str | float = Field(
        0.1, description="KV cache size: bytes (2GiB, 512MiB) or a fraction of available memory")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    attention_backend: Literal["auto", "metal", "cpu", "reference"] = Field(
        "auto", description="paged attention: Metal kernels (Apple GPUs), the C kernel (CPUs with AVX2, "
                    "AVX-512 or NEON), the MLX reference path, or auto (the first that runs here)")
    cpu_threads: int | None = Field(
        None, ge=1, description="threads the CPU kernels use (default: the CPUs no other process keeps "
                                "busy, re-read four times a second)")
    kv_layout: Literal["auto", "block", "head"] = Field(
        "auto", description="KV cache layout: head-major (auto on CPUs) or block-major (what the Metal "
                            "kernels read)")
    speculative_config: dict[str, Any] | None = Field(
        None, description="speculative decoding config as JSON, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}'")
    speculative_disable_by_batch_size: int | None = Field(
        None, ge=1, description="turn speculation off while more requests than this are running "
                                "(same as disable_by_batch_size in --speculative-config)")
    per_request_spec_decode_metrics: Literal["off", "summary"] = Field(
        "off", description="`summary`: add per-request draft/accept counts to `usage.spec_decode`")
    async_scheduling: bool = Field(
        False, description="accepted for vLLM compatibility; the engine is synchronous")
    seed: int | None = Field(None, description="seed of the sampling key stream for unseeded requests")
    generation_config: str = Field(
        "auto", description="sampling defaults for fields a request leaves out: `auto` takes the model "
                            "folder's generation_config.json, `vllm` keeps OpenAI's, or a FOLDER holding one")
    override_generation_config: dict[str, Any] | None = Field(
        None, description="sampling defaults as JSON, merged over --generation-config's, e.g. "
                          "'{\"temperature\": 0.6, \"max_new_tokens\": 512}'")
    chat_template: str | None = Field(
        None, description="chat template FILE (or inline Jinja text) overriding the model's")
    trust_remote_code: bool = Field(
        False, description="accepted for vLLM compatibility (no remote code is run)")

    # -- prompts and chat templates --------------------------------------------------------------
    trust_request_chat_template: bool = Field(
        False, description="let requests bring their own chat template (`chat_template`, or the "
                           "`chat_template` key of `chat_template_kwargs`); refused with 400 otherwise")
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="chat template variables as JSON, e.g. '{\"enable_thinking\": false}'; a "
                          "request's `chat_template_kwargs` override them")
    chat_template_timeout: float = Field(
        5.0, gt=0, description="seconds a chat template may take to render; past them the request gets 400")
    enable_auto_tool_choice: bool = Field(
        False, description="let the model decide to call tools (`tool_choice` auto, the default when a "
                           "request has `tools`); needs --tool-call-parser")
    tool_call_parser: str | None = Field(
        None, description="how tool calls are read out of the model's text: hermes (Qwen2.5/Qwen3, the "
                          "default model's shipped template), llama3_json, mistral")
    reasoning_parser: str | None = Field(
        None, description="put a thinking model's `<think>...</think>` in `reasoning_content`: qwen3, "
                          "deepseek_r1")
    max_prompt_chars: int | None = Field(
        None, ge=1, description="longest prompt (or chat) in characters, refused with 400 before tokenizing "
                                "(default: max_model_len x the longest vocabulary entry, which no prompt "
                                "that fits the context exceeds)")
    preprocess_threads: int = Field(
        2, ge=1, description="threads that render chat templates and tokenize, off the event loop")

    # -- HTTP ----------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind")
    api_key: str | None = Field(
        None, description="require `Authorization: Bearer KEY` on every endpoint but /health and /metrics "
                          "(also read from SPECSERVE_API_KEY)")
    max_waiting_requests: int | None = Field(
        None, ge=0, description="answer 503 to a request whose engine requests (prompts x n) would make more "
                                "than this many wait for a running slot (default: no limit)")
    max_request_body_size: int = Field(
        2 * 2**20, ge=1, description="largest request body in bytes, or with a unit (2MiB); 413 above")
    max_n: int = Field(16, ge=1, description="largest `n` (choices per prompt) accepted")
    max_stop_strings: int = Field(64, ge=0, description="most `stop` strings in one request; 400 above")
    max_stop_chars: int = Field(
        8192, ge=0, description="most characters in one request's `stop` strings together; 400 above")
    max_stop_token_ids: int = Field(
        256, ge=0, description="most `stop_token_ids` in one request (at most 1000); 400 above")
    request_timeout: float | None = Field(
        None, gt=0, description="seconds a request may take in all; past it the request is aborted and "
                                "answered 408 (default: no limit)")
    shutdown_timeout: float = Field(
        3.0, ge=0, description="after SIGTERM/Ctrl-C, seconds running requests get to finish before they "
                               "are aborted")

    # -- one model over several ranks (mx.distributed; server/tensor_parallel.py) ---------------
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks the model's layers are split over (mx.distributed, ring backend); "
                             "this machine's ranks are started here, others with --hostfile")
    hostfile: str | None = Field(
        None, description="MLX hostfile (JSON: ssh name and IPs per host) to run the ranks on several "
                          "machines through MLX's launcher")

    # -- replicas (Ray Serve; server/replicas.py) ------------------------------------------------
    replicas: int = Field(
        1, ge=1, description="engine replicas behind Ray Serve's HTTP proxy (above 1: starts or joins a Ray "
                             "cluster; needs the `ray` extra)")
    max_replicas: int | None = Field(
        None, ge=1, description="autoscale between --replicas and this many when requests wait for a slot")
    ray_address: str | None = Field(
        None, description="Ray cluster to join (`auto`, host:port; default: RAY_ADDRESS, else a local one)")
    replica_cpus: float | None = Field(
        None, gt=0, description="Ray CPUs each replica reserves, and so its compute threads (default: this "
                                "machine's cores / --max-replicas, or / --replicas)")
    replica_routing: Literal["prefix", "power-of-two"] = Field(
        "prefix", description="how requests pick a replica: the one that saw the longest prefix of the "
                              "conversation (else the least loaded), or Serve's default")

    # Test-only (engine/faults.py; no CLI flag): fault kind -> trigger token id.
    fault_injection: dict[str, int] | None = Field(None, description="test-only fault injection")

    # -- logging -------------------------------------------------------------------------------
    log_level: LogLevel = Field("info", description="log level of specserve")
    uvicorn_log_level: UvicornLogLevel = Field("info", description="log level of uvicorn")
    disable_log_requests: bool = Field(False, description="do not log each request")
    log_stats_interval: float = Field(10.0, ge=0, description="seconds between stats log lines (0: off)")
    disable_log_stats: bool = Field(False, description="no periodic stats log lines")
    step_trace: str | None = Field(
        None, description="append one JSON line per engine step to FILE (step time, requests, tokens, "
                          "drafts, the K chosen per request, the adaptive cost model): `python -m "
                          "loadtests.traces FILE` summarises it")

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        if v is not None and not v:
            raise ValueError("served_model_name needs at least one name")
        return v

    @field_validator("max_request_body_size", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return parse_size(v) if isinstance(v, (int, str)) else v

    @field_validator("max_stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: int) -> int:
        from engine.sampling import MAX_STOP_TOKEN_IDS

        if v > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"the engine takes at most {MAX_STOP_TOKEN_IDS} stop token ids per request")
        return v

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, v: str | float) -> str | float:
        from engine.config import parse_memory

        parse_memory(v)
        return v

    @field_validator("attention_backend")
    @classmethod
    def _attention(cls, v: str) -> str:
        """`metal` without a Metal device fails here, before the model loads (the engine checks again)."""
        from engine.attention.selector import select_attention

        select_attention(v)  # type: ignore[arg-type]
        return v

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _parser(cls, v: str | None, info: ValidationInfo) -> str | None:
        from server.tools import PARSERS, REASONING_PARSERS

        known = PARSERS if info.field_name == "tool_call_parser" else REASONING_PARSERS
        if v is not None and v not in known:
            what = "tool call" if info.field_name == "tool_call_parser" else "reasoning"
            raise ValueError(f"unknown {what} parser {v!r} (known: {', '.join(known)})")
        return v

    @model_validator(mode="after")
    def _auto_tools(self) -> ServerSettings:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                             "(hermes, llama3_json, mistral)")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"--max-replicas {self.max_replicas} is below --replicas {self.replicas}")
        if self.tensor_parallel_size > 1 and (self.replicas > 1 or self.max_replicas is not None):
            raise ValueError("--tensor-parallel-size with --replicas is not supported: replicas are "
                             "single-rank engines")
        if self.hostfile is not None and self.tensor_parallel_size < 2:
            raise ValueError("--hostfile needs --tensor-parallel-size 2 or more")
        return self

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        """A FILE is read here, so the engine always gets template text; inline Jinja passes through."""
        if v is None or "{{" in v or "{%" in v:
            return v
        from pathlib import Path

        path = Path(v).expanduser()
        if not path.is_file():
            raise ValueError(f"chat template file {v!r} does not exist")
        return path.read_text()

    @field_validator("generation_config")
    @classmethod
    def _generation(cls, v: str) -> str:
        """auto, vllm, or a folder holding generation_config.json (checked before the model loads)."""
        if v in ("auto", "vllm"):
            return v
        from pathlib import Path

        folder = Path(v).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"--generation-config {v!r}: expected auto, vllm or a folder holding "
                             "generation_config.json")
        return str(folder)

    @field_validator("override_generation_config")
    @classmethod
    def _generation_override(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        from engine.models.loader import GENERATION_DEFAULT_KEYS, sampling_defaults

        unknown = sorted(set(v) - set(GENERATION_DEFAULT_KEYS))
        if unknown:
            raise ValueError(f"--override-generation-config: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(GENERATION_DEFAULT_KEYS)})")
        sampling_defaults(v, "--override-generation-config")
        return v

    @field_validator("step_trace")
    @classmethod
    def _trace(cls, v: str | None) -> str | None:
        """Checked at startup, before the model loads: a trace that cannot be written is a bad flag."""
        if v is None:
            return v
        from pathlib import Path

        path = Path(v).expanduser()
        if path.is_dir() or not path.parent.is_dir():
            raise ValueError(f"step trace {v!r}: not a file in an existing directory")
        return str(path)

    def _spec_config(self) -> dict[str, Any] | None:
        spec = self.speculative_config
        if self.speculative_disable_by_batch_size is None:
            return spec
        if spec is None:
            raise ValueError("--speculative-disable-by-batch-size needs --speculative-config")
        return {**spec, "disable_by_batch_size": self.speculative_disable_by_batch_size}

    def engine_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `engine.config.EngineConfig`."""
        return {
            "model": self.model, "revision": self.revision, "dtype": self.dtype,
            "quantization": self.quantization, "activation_precision": self.activation_precision,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens, "block_size": self.block_size,
            "kv_cache_memory": self.kv_cache_memory, "enable_prefix_caching": self.enable_prefix_caching,
            "attention_backend": self.attention_backend, "kv_layout": self.kv_layout,
            "fault_injection": self.fault_injection,
            "seed": self.seed, "chat_template": self.chat_template,
            "trust_remote_code": self.trust_remote_code,
            "speculative_config": self._spec_config(),
            "tensor_parallel_size": self.tensor_parallel_size,
        }
