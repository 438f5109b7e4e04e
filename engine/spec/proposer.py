"""The interface every speculative method implements: token lists in, draft lists out, no scheduler state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.sampling import SamplingParams
from engine.step import FeatureRows, HiddenRow


@dataclass(slots=True)
class DraftRequest:
    request_id: str
    token_ids: list[int]  # prompt + output, all confirmed (read-only: the request's own list)
    num_prompt_tokens: int
    num_drafts: int  # the most drafts wanted this step (>= 1; 0: take in features, see shares_target_blocks)
    block_table: list[int] | None = None  # the target's (read-only): MTP reads its paged KV, EAGLE-3 writes
    cache_salt: str | None = None  # suffix decoding shares past responses only within one salt
    params: SamplingParams | None = None  # probabilistic drafters process their distribution the same way
    hidden: HiddenRow | None = None  # MTP: the target's hidden row behind the newest token
    # EAGLE-3: target features of the positions confirmed since the request last drafted.
    features: list[FeatureRows] = field(default_factory=list)


class Proposer(Protocol):
    # Read-only: an implementation may define these as class attributes.
    @property
    def drafts_before_choice(self) -> bool:
        """Drafting is nearly free (lookups): under adaptive K the engine drafts before choosing K."""
        ...

    @property
    def filters_drafts(self) -> bool:
        """The proposer drops drafts it is unsure of (MTP's draft_min_token_prob): no back-off then."""
        ...

    @property
    def shares_target_blocks(self) -> bool:
        """The proposer keeps its own KV at the target's block ids (EAGLE-3): the target's blocks must
        cover the positions its drafts write, and it takes every step's features, drafting or not
        (`num_drafts` 0), so that prefix-cached blocks hold its KV too."""
        ...

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """One draft list per request, each at most `num_drafts` long (possibly empty)."""
        ...

    def catch_up_tokens(self, request: DraftRequest) -> int:
        """Tokens the proposer would process before its first draft (state that fell behind while the
        request was not drafting); adaptive K spaces out probes that need it."""
        ...

    def draft_probs(self) -> dict[str, np.ndarray]:
        """request id -> q [drafts, vocab] the last `propose` sampled from (empty when deterministic)."""
        ...

    def release(self, request_id: str, finished: bool) -> None:
        """Forget per-request state. `finished` is False for a preemption (the request comes back)."""
        ...
