"""What crosses the scheduler / runner / speculation boundaries in one step: plain dataclasses, importing
nothing from the engine but sampling parameters (for annotations)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from engine.sampling import SamplingParams, TokenLogprob


class GrammarRows(Protocol):
    """A request's grammar over this step's logits rows (row i: after the first i drafts)."""

    def masks(self) -> np.ndarray: ...

    def mask(self, i: int) -> np.ndarray: ...

    def allows(self, i: int, token: int) -> bool: ...


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # tokens to compute this step
    start_pos: int  # position of token_ids[0] (== num_computed_tokens)
    block_table: list[int]  # the manager's list: read-only for the runner
    num_logits: int  # 0: mid-prefill chunk, 1: sample one token, 1 + k: verify k drafts
    spec_token_ids: list[int]
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: list[int]
    # Probabilistic drafters: the distributions drafts were drawn from, q [>= k, vocab].
    draft_probs: np.ndarray | None = None
    # Structured outputs: set by the engine before the runner runs.
    grammar: GrammarRows | None = None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def decode_only(self) -> bool:
        """Every request computes only rows it reads logits from (decodes and verifications)."""
        return all(sr.num_logits == len(sr.token_ids) for sr in self.scheduled)


@dataclass(slots=True)
class HiddenRow:
    """The target's final hidden state of the row that produced a request's newest token (MTP's input)."""

    position: int
    row: Any  # an array handle; only the runner and the MTP proposer read it


@dataclass(slots=True)
class FeatureRows:
    """EAGLE-3 target features (chosen layers' inputs, concatenated) of consecutive positions from `start`
    whose KV a step confirmed."""

    start: int
    rows: Any  # [n, width] array handle

    @property
    def end(self) -> int:
        return self.start + int(self.rows.shape[0])


@dataclass(slots=True)
class RunnerOutput:
    # Per scheduled request: tokens to append (accepted drafts + one sampled), empty mid-prefill.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    num_accepted_drafts: list[int] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    # Per scheduled request: its hidden row where the runner keeps them (MTP), else None.
    hidden: list[HiddenRow | None] = field(default_factory=list)
    # Per scheduled request: its confirmed positions' features (EAGLE-3), else None.
    features: list[FeatureRows | None] = field(default_factory=list)

    def extend(self, other: RunnerOutput) -> None:
        self.sampled_token_ids += other.sampled_token_ids
        self.logprobs += other.logprobs
        self.num_accepted_drafts += other.num_accepted_drafts
        self.errors += other.errors
        self.hidden += other.hidden
        self.features += other.features

    @classmethod
    def failed(cls, num_requests: int, error: str) -> RunnerOutput:
        """Every request of a step failed with `error` (no tokens)."""
        n = num_requests
        return cls(sampled_token_ids=[[] for _ in range(n)], logprobs=[None] * n, num_accepted_drafts=[0] * n,
                   errors=[error] * n, hidden=[None] * n, features=[None] * n)
