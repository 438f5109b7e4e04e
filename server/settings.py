"""Server settings: one pydantic model fed by the CLI flags and `--config FILE.yaml` alike.

It inherits the engine's options (engine.config.EngineOptions) and adds the server's own: each option is
declared once, as a field, and the CLI builds its flags, their help and defaults from the fields.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.config import EngineOptions, Flag, read_config_file
from engine.sampling import MAX_STOP_TOKEN_IDS

if TYPE_CHECKING:
    from engine.attention.types import AttentionBackend  # imports MLX

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
UvicornLogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]

_SIZE_RE = re.compile(r"^\s*([0-9]+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30}

_SECONDS = Flag(metavar="SECONDS")
_FILE = Flag(metavar="FILE")
_JSON = Flag(metavar="JSON")


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


class ServerSettings(EngineOptions):
    """The engine's options (inherited) and the server's."""

    # -- model and engine (vLLM's flag names) --------------------------------------------------
    served_model_name: Annotated[list[str] | None, Flag(metavar="NAME")] = Field(
        None, description="name(s) clients may use in `model`; the first is reported "
                          "(default: the model's name)")
    cpu_threads: Annotated[int | None, Flag(metavar="N")] = Field(
        None, ge=1, description="threads the CPU kernels use (default: the CPUs no other process keeps "
                                "busy, re-read four times a second)")
    speculative_disable_by_batch_size: int | None = Field(
        None, ge=1, description="turn speculation off while more requests than this are running "
                                "(same as disable_by_batch_size in --speculative-config)")
    per_request_spec_decode_metrics: Literal["off", "summary"] = Field(
        "off", description="`summary`: add per-request draft/accept counts to `usage.spec_decode`")
    async_scheduling: Annotated[bool, Flag(negatable=True)] = Field(
        False, description="accepted for vLLM compatibility; the engine is synchronous")
    generation_config: Annotated[str, Flag(metavar="auto|vllm|FOLDER")] = Field(
        "auto", description="sampling defaults for fields a request leaves out: `auto` takes the model "
                            "folder's generation_config.json, `vllm` keeps OpenAI's, or a FOLDER holding one")
    override_generation_config: Annotated[dict[str, Any] | None, _JSON] = Field(
        None, description="sampling defaults as JSON, merged over --generation-config's, e.g. "
                          "'{\"temperature\": 0.6, \"max_new_tokens\": 512}'")

    # -- prompts and chat templates --------------------------------------------------------------
    trust_request_chat_template: bool = Field(
        False, description="let requests bring their own chat template (`chat_template`, or the "
                           "`chat_template` key of `chat_template_kwargs`); refused with 400 otherwise")
    default_chat_template_kwargs: Annotated[dict[str, Any] | None, _JSON] = Field(
        None, description="chat template variables as JSON, e.g. '{\"enable_thinking\": false}'; a "
                          "request's `chat_template_kwargs` override them")
    chat_template_timeout: Annotated[float, _SECONDS] = Field(
        5.0, gt=0, description="seconds a chat template may take to render; past them the request gets 400")
    enable_auto_tool_choice: bool = Field(
        False, description="let the model decide to call tools (`tool_choice` auto, the default when a "
                           "request has `tools`); needs --tool-call-parser")
    tool_call_parser: Annotated[str | None, Flag(metavar="NAME")] = Field(
        None, description="how tool calls are read out of the model's text: hermes (Qwen2.5/Qwen3, the "
                          "default model's shipped template), llama3_json, mistral")
    reasoning_parser: Annotated[str | None, Flag(metavar="NAME")] = Field(
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
    api_key: Annotated[str | None, Flag(metavar="KEY")] = Field(
        None, description="require `Authorization: Bearer KEY` on every endpoint but /health and /metrics "
                          "(also read from SPECSERVE_API_KEY)")
    max_waiting_requests: int | None = Field(
        None, ge=0, description="answer 503 to a request whose engine requests (prompts x n) would make more "
                                "than this many wait for a running slot (default: no limit)")
    max_request_body_size: Annotated[int, Flag(metavar="SIZE", text=True)] = Field(
        2 * 2**20, ge=1, description="largest request body in bytes, or with a unit (2MiB); 413 above")
    max_n: int = Field(16, ge=1, description="largest `n` (choices per prompt) accepted")
    max_stop_strings: int = Field(64, ge=0, description="most `stop` strings in one request; 400 above")
    max_stop_chars: int = Field(
        8192, ge=0, description="most characters in one request's `stop` strings together; 400 above")
    max_stop_token_ids: int = Field(
        256, ge=0, description="most `stop_token_ids` in one request (at most 1000); 400 above")
    request_timeout: Annotated[float | None, _SECONDS] = Field(
        None, gt=0, description="seconds a request may take in all; past it the request is aborted and "
                                "answered 408 (default: no limit)")
    shutdown_timeout: Annotated[float, _SECONDS] = Field(
        3.0, ge=0, description="after SIGTERM/Ctrl-C, seconds running requests get to finish before they "
                               "are aborted")

    # -- one model over several machines (--tensor-parallel-size is the engine's) ---------------
    hostfile: Annotated[str | None, _FILE] = Field(
        None, description="MLX hostfile (JSON: ssh name and IPs per host) to run the ranks on several "
                          "machines through MLX's launcher")

    # -- replicas (Ray Serve; server/replicas.py) ------------------------------------------------
    replicas: int = Field(
        1, ge=1, description="engine replicas behind Ray Serve's HTTP proxy (above 1: starts or joins a Ray "
                             "cluster; needs the `ray` extra)")
    max_replicas: int | None = Field(
        None, ge=1, description="autoscale between --replicas and this many when requests wait for a slot")
    ray_address: Annotated[str | None, Flag(metavar="ADDRESS")] = Field(
        None, description="Ray cluster to join (`auto`, host:port; default: RAY_ADDRESS, else a local one)")
    replica_cpus: float | None = Field(
        None, gt=0, description="Ray CPUs each replica reserves, and so its compute threads (default: this "
                                "machine's cores / --max-replicas, or / --replicas)")
    replica_routing: Literal["prefix", "power-of-two"] = Field(
        "prefix", description="how requests pick a replica: the one that saw the longest prefix of the "
                              "conversation (else the least loaded), or Serve's default")

    # -- logging -------------------------------------------------------------------------------
    log_level: LogLevel = Field("info", description="log level of specserve")
    uvicorn_log_level: UvicornLogLevel = Field("info", description="log level of uvicorn")
    disable_log_requests: bool = Field(False, description="do not log each request")
    log_stats_interval: Annotated[float, _SECONDS] = Field(
        10.0, ge=0, description="seconds between stats log lines (0: off)")
    disable_log_stats: bool = Field(False, description="no periodic stats log lines")
    step_trace: Annotated[str | None, _FILE] = Field(
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
        if v > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"the engine takes at most {MAX_STOP_TOKEN_IDS} stop token ids per request")
        return v

    @field_validator("speculative_config")
    @classmethod
    def _spec_mapping(cls, v: Any) -> Any:
        """The engine parses it when it starts; here it is the mapping the flag or the file gave."""
        if v is not None and not isinstance(v, dict):
            raise PydanticCustomError("dict_type", "Input should be a valid dictionary")
        return v

    @field_validator("attention_backend")
    @classmethod
    def _attention(cls, v: AttentionBackend) -> AttentionBackend:
        """`metal` without a Metal device fails here, before the model loads (the engine checks again)."""
        from engine.attention.selector import select_attention  # imports MLX: after platform.setup()

        select_attention(v)
        return v

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _parser(cls, v: str | None, info: ValidationInfo) -> str | None:
        from server.tools import PARSERS, REASONING_PARSERS  # imports FastAPI: slow for `specserve --help`

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
        # imports MLX: after platform.setup()
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
        """Keyword arguments for `engine.config.EngineConfig`: the engine's options, as set here."""
        kwargs = {name: getattr(self, name) for name in EngineOptions.model_fields}
        kwargs["speculative_config"] = self._spec_config()
        return kwargs


def load_config_file(name: str) -> dict[str, Any]:
    """`--config FILE.yaml` (or a shipped config's name) as settings values; a key that names no setting
    is an error. Raises ValueError."""
    return read_config_file(name, known=ServerSettings.model_fields)
