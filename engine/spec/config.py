"""`--speculative-config`: one pydantic model per method, vLLM's keys; an invalid configuration raises
`SpeculativeConfigError` at start-up naming the key (no silent fallback)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from engine.spec.rejection import RejectionConfig

Method = Literal["ngram", "suffix", "draft_model", "mtp"]

# Keys users bring over from elsewhere: a message each, not "extra key".
_MISPLACED = {
    "tensor_parallel_size": "tensor_parallel_size is not allowed inside --speculative-config; the draft "
                            "runs with draft_tensor_parallel_size (only 1 is supported)",
    "temperature": "temperature is a per-request sampling parameter, not part of --speculative-config "
                   "(every request's drafts are verified against its own sampling settings)",
    "top_p": "top_p is a per-request sampling parameter, not part of --speculative-config "
             "(every request's drafts are verified against its own sampling settings)",
    "top_k": "top_k is a per-request sampling parameter, not part of --speculative-config",
}


class SpeculativeConfigError(ValueError):
    pass


# The most K under "auto" (adaptive.max_num_speculative_tokens overrides it).
_AUTO_MAX_K = {"ngram": 6, "suffix": 8, "draft_model": 4, "mtp": 3, "eagle3": 3}


class AdaptiveConfig(BaseModel):
    """The `adaptive` block that comes with `"num_speculative_tokens": "auto"` (engine/spec/adaptive.py)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    max_num_speculative_tokens: int | None = Field(None, ge=1, le=64)
    # Weight of the newest verification in the per-request, per-position acceptance estimate.
    acceptance_ema: float = Field(0.1, gt=0, le=1)
    # An idle request is re-probed after this many steps, then twice as many, and so on.
    probe_interval: int = Field(4, ge=1)


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    num_speculative_tokens: int = Field(ge=1, le=64)
    # Speculation off above this many running requests (vLLM's speculative_disable_by_batch_size).
    disable_by_batch_size: int | None = Field(None, ge=1)
    # [[max_batch_size, k], ...] ascending: b running requests draft the k of the first entry with
    # b <= max_batch_size, none above the last.
    num_speculative_tokens_per_batch_size: list[list[int]] | None = None
    draft_tensor_parallel_size: Literal[1] | None = None
    # Set under "auto"; num_speculative_tokens is then the most K can be.
    adaptive: AdaptiveConfig | None = None
    max_model_len: int | None = Field(None, ge=16)
    revision: str | None = None
    quantization: str | None = None
    # How sampled requests' drafts are verified (docs/speculative-decoding.md#sampled-requests).
    rejection_sample_method: Literal["standard", "strict", "block", "synthetic", "typical"] = "standard"
    synthetic_acceptance_rate: float | None = Field(None, ge=0, le=1)
    posterior_threshold: float = Field(0.09, ge=0, le=1)
    posterior_alpha: float = Field(0.3, ge=0)

    @model_validator(mode="after")
    def _check_rejection(self) -> _Base:
        synthetic = self.rejection_sample_method == "synthetic"
        if synthetic != (self.synthetic_acceptance_rate is not None):
            raise ValueError("synthetic_acceptance_rate: set it exactly when rejection_sample_method is "
                             "synthetic")
        return self

    @property
    def rejection(self) -> RejectionConfig:
        method = "standard" if self.rejection_sample_method == "strict" else self.rejection_sample_method
        return RejectionConfig(method, self.synthetic_acceptance_rate, self.posterior_threshold,
                               self.posterior_alpha)

    @property
    def lossless(self) -> bool:
        return self.rejection.method in ("standard", "block")

    @model_validator(mode="after")
    def _check_table(self) -> _Base:
        table = self.num_speculative_tokens_per_batch_size
        if table:
            if any(len(pair) != 2 for pair in table):
                raise ValueError("num_speculative_tokens_per_batch_size: entries are "
                                 "[max_batch_size, k] pairs")
            sizes = [b for b, _ in table]
            if sizes != sorted(sizes) or len(set(sizes)) != len(sizes) or sizes[0] < 1:
                raise ValueError("num_speculative_tokens_per_batch_size: batch sizes must be >= 1 and "
                                 "strictly ascending")
            if any(not 0 <= k <= self.num_speculative_tokens for _, k in table):
                raise ValueError("num_speculative_tokens_per_batch_size: each k must be between 0 and "
                                 "num_speculative_tokens")
        return self

    def tokens_for_batch(self, num_running: int) -> int:
        """How many drafts per request at this load (0 = speculation off this step)."""
        if self.disable_by_batch_size is not None and num_running > self.disable_by_batch_size:
            return 0
        table = self.num_speculative_tokens_per_batch_size
        if table:
            return next((k for b, k in table if num_running <= b), 0)
        return self.num_speculative_tokens

    @property
    def needs_model(self) -> bool:
        return False


class NgramConfig(_Base):
    method: Literal["ngram"] = "ngram"
    prompt_lookup_min: int = Field(5, ge=1)
    prompt_lookup_max: int = Field(5, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _lookup_defaults(cls, data: Any) -> Any:
        # vLLM's defaulting: both 5 when both are omitted, else one mirrors the other.
        if isinstance(data, dict):
            lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
            if lo is None and hi is not None:
                data = {**data, "prompt_lookup_min": hi}
            elif hi is None and lo is not None:
                data = {**data, "prompt_lookup_max": lo}
        return data

    @model_validator(mode="after")
    def _check_range(self) -> NgramConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


class SuffixConfig(_Base):
    method: Literal["suffix"] = "suffix"
    num_speculative_tokens: int = Field(24, ge=1, le=64)
    suffix_decoding_max_tree_depth: int = Field(24, ge=1)
    suffix_decoding_max_cached_requests: int = Field(10000, ge=0)
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0)
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _k_default(cls, data: Any) -> Any:
        # Like vLLM: the draft length defaults to the tree depth.
        if isinstance(data, dict) and "num_speculative_tokens" not in data:
            data = {**data, "num_speculative_tokens": data.get("suffix_decoding_max_tree_depth", 24)}
        return data


class _ModelDrafter(_Base):
    # Sampled requests' drafts: greedy (the argmax) or probabilistic (drawn from q; min(1, p/q)).
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"


class DraftModelConfig(_ModelDrafter):
    method: Literal["draft_model"] = "draft_model"
    model: str = Field(min_length=1)
    # Share of --kv-cache-memory for the draft's KV cache (ours). Unset: a block beside each target block
    # with a static K, a quarter of that with "auto".
    draft_kv_cache_fraction: float | None = Field(None, gt=0, lt=1)
    # The draft's weight precision (vLLM's key): q8 / q4 quantize a float draft at load; unset: as stored.
    quantization: Literal["q8", "q4"] | None = None

    @property
    def needs_model(self) -> bool:
        return True


_Prob = Annotated[float, Field(ge=0, lt=1)]
# Ours (mtp, eagle3): auto runs the head's passes in C where they apply, else MLX; mlx: always MLX (the C
# loop's reference).
DraftBackend = Literal["auto", "mlx"]


class MTPConfig(_ModelDrafter):
    method: Literal["mtp"] = "mtp"
    model: str = Field(min_length=1)
    num_speculative_tokens: int = Field(1, ge=1, le=16)
    # Ours: a draft stops at the first token below this probability (a list: one cut-off per position, the
    # last repeating), so unlikely drafts cost no verification (docs/mtp.md).
    draft_min_token_prob: _Prob | Annotated[list[_Prob], Field(min_length=1)] = 0.0
    draft_backend: DraftBackend = "auto"

    @property
    def needs_model(self) -> bool:
        return True


class Eagle3Config(_Base):
    method: Literal["eagle3"] = "eagle3"
    model: str = Field(min_length=1)
    num_speculative_tokens: int = Field(1, ge=1, le=16)
    # The target layers whose inputs the head fuses (the checkpoint's, else 2, L // 2, L - 3).
    eagle_aux_hidden_state_layer_ids: Annotated[list[int], Field(min_length=3, max_length=3)] | None = None
    # Drafts are the head's argmax; sampled requests verify them with the coupled rule.
    draft_sample_method: Literal["greedy"] = "greedy"
    draft_backend: DraftBackend = "auto"

    @property
    def needs_model(self) -> bool:
        return True


SpeculativeConfig = Annotated[NgramConfig | SuffixConfig | DraftModelConfig | MTPConfig | Eagle3Config,
                              Field(discriminator="method")]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(SpeculativeConfig)


def _format(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = [str(x) for x in err["loc"] if x not in ("ngram", "suffix", "draft_model", "mtp", "eagle3")]
        key = ".".join(loc) or "speculative_config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "union_tag_invalid":
            key, msg = "method", "must be one of ngram, suffix, draft_model, mtp, eagle3"
        parts.append(f"{key}: {msg}")
    return "; ".join(parts)


def parse_speculative_config(value: str | dict[str, Any] | None) -> Any:
    """JSON text or a mapping (from --config YAML) -> a config model, or None when not given."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"invalid --speculative-config: not valid JSON ({e})") from None
    else:
        data = dict(value)
    if not isinstance(data, dict):
        raise SpeculativeConfigError("invalid --speculative-config: expected a JSON object")
    for key, msg in _MISPLACED.items():
        if key in data:
            raise SpeculativeConfigError(f"invalid --speculative-config: {msg}")
    if "method" not in data:
        # vLLM's inference: model "ngram" means the ngram method, any other model a draft model.
        model = data.get("model")
        if model == "ngram":
            data = {k: v for k, v in data.items() if k != "model"} | {"method": "ngram"}
        elif isinstance(model, str) and model:
            data = {**data, "method": "draft_model"}
        else:
            raise SpeculativeConfigError(
                "invalid --speculative-config: method: missing (one of ngram, suffix, draft_model, mtp, "
                "eagle3), and no model to infer it from")
    method = data.get("method")
    if method == "eagle":
        raise SpeculativeConfigError("invalid --speculative-config: method: EAGLE-1 heads ('eagle') are not "
                                     "supported; EAGLE-3 heads are ('eagle3')")
    if method in ("draft_model", "mtp", "eagle3") and not data.get("model"):
        raise SpeculativeConfigError(f"invalid --speculative-config: model: method {method!r} needs a model")
    if method in ("ngram", "suffix") and "model" in data and data["model"] not in (None, method):
        raise SpeculativeConfigError(f"invalid --speculative-config: model: method {method!r} takes no model")
    data = {k: v for k, v in data.items() if not (k == "model" and method in ("ngram", "suffix"))}
    data = _resolve_auto(data)
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as e:
        raise SpeculativeConfigError(f"invalid --speculative-config: {_format(e)}") from None


def _resolve_auto(data: dict[str, Any]) -> dict[str, Any]:
    """`"num_speculative_tokens": "auto"` -> an adaptive block and K = its maximum."""
    k = data.get("num_speculative_tokens")
    if k != "auto":
        if "adaptive" in data:
            raise SpeculativeConfigError('invalid --speculative-config: adaptive: needs '
                                         '"num_speculative_tokens": "auto"')
        return data
    adaptive = data.get("adaptive") or {}
    if not isinstance(adaptive, dict):
        raise SpeculativeConfigError("invalid --speculative-config: adaptive: expected an object")
    max_k = adaptive.get("max_num_speculative_tokens") or _AUTO_MAX_K.get(str(data.get("method")), 4)
    return {**data, "num_speculative_tokens": max_k, "adaptive": adaptive}
