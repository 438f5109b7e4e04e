"""Sampling parameters and the plain records the sampler (engine/sampler.py) reads and returns; no MLX."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1000
MASK64 = (1 << 64) - 1
MAX_CACHE_SALT_CHARS = 256


# Temperature buckets (Prometheus labels, adaptive K's prior keys): greedy, then (0, 0.5], (0.5, 1], above 1.
TEMPERATURE_BUCKETS = ("0", "(0,0.5]", "(0.5,1]", ">1")


def temperature_bucket(t: float) -> str:
    """The bucket of `TEMPERATURE_BUCKETS` holding temperature `t`."""
    if t < _GREEDY_EPS:
        return "0"
    if t <= 0.5:
        return "(0,0.5]"
    return "(0.5,1]" if t <= 1.0 else ">1"


def _check_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _check_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What a request's output must match (vLLM's `structured_outputs`): exactly one of a JSON schema (as
    text), any JSON object, a regex, a choice of strings, or a Lark / GBNF grammar."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # vLLM's: JSON without optional whitespace, so more tokens are fixed by the schema (drafted for free).
    disable_any_whitespace: bool = False

    def validate(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, regex, choice "
                             f"and grammar, got {given or 'none'}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs choice must be a non-empty list of strings")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the model's max length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # k >= 0: the sampled token's logprob and the top k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's cache isolation: prefix-cache blocks and suffix trees are shared only within one salt (not a
    # sampling option, but it travels with them).
    cache_salt: str | None = None
    structured: StructuredOutputs | None = None

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError (the message starts with the field) for out-of-range values."""
        if self.structured is not None:
            self.structured.validate()
        _check_finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        _check_finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(1 << 63) <= self.seed <= MASK64:
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                             "characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids")
        for tok in self.stop_token_ids:
            _check_int("stop_token_ids", tok)
            if not 0 <= tok < vocab_size:
                raise ValueError(f"stop_token_ids entry {tok} is outside the vocabulary [0, {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def argmax_only(self) -> bool:
        """True when the next token is the raw logits' argmax at every position, so drafts verify by argmax
        alone (penalties, min_tokens and logprobs need the sampler)."""
        return self.is_greedy and not self.has_penalties and self.logprobs is None and self.min_tokens == 0


@dataclass(slots=True)
class RowState:
    """One row of the logits to sample, built by the runner."""

    params: SamplingParams
    output_token_ids: list[int]  # generated so far: penalties, min_tokens, seeded key step
    prompt_token_ids: list[int]  # repetition_penalty covers prompt + output (as vLLM)
    eos_token_ids: list[int]  # banned (with stop_token_ids) while len(output) < min_tokens


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # k alternatives (id, logprob), descending


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
