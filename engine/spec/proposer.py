"""The one interface every speculative method implements.

A proposer sees plain lists (the request's confirmed tokens) and returns draft token lists. It never
touches scheduler state; per-request state it keeps (a draft model's KV, a suffix tree) is released
through `release()` when the engine says the request ended or was preempted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.sampling import SamplingParams


@dataclass(slots=True)
class DraftRequest:
    request_id: str
    token_ids: list[int]  # prompt + output, all confirmed (read-only: the request's own list)
    num_prompt_tokens: int
    num_drafts: int  # the most drafts wanted this step (>= 1)
    # The target's block table (read-only): MTP assistants attend over the target's paged KV.
    block_table: list[int] | None = None
    # The request's cache_salt: state shared across requests (suffix decoding's past responses) is
    # only shared between requests of the same salt.
    cache_salt: str | None = None
    # The request's sampling settings: drafters that sample (draft_sample_method "probabilistic") draw
    # its drafts from their own distribution processed the same way.
    params: SamplingParams | None = None


class Proposer(Protocol):
    # True where drafting costs next to nothing and the drafts for K are the first K of the drafts for
    # any larger K (n-gram lookup, suffix tries): with "auto" the engine drafts first, at the most
    # each request may take, and the controller chooses knowing which requests have drafts and how
    # many. Drafts that cost a forward (a draft model, an assistant) are chosen before they are made.
    drafts_before_choice: bool
    # True where the proposer itself drops drafts it is unsure of, token by token (MTP with
    # draft_min_token_prob): the per-request back-off after rejected drafts would then only skip steps
    # whose drafts were judged worth verifying, which costs speed: such proposers skip it.
    filters_drafts: bool

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """One draft list per request, each at most `num_drafts` long (possibly empty)."""
        ...

    def catch_up_tokens(self, request: DraftRequest) -> int:
        """Tokens the proposer would process for this request before its first draft (state that fell
        behind while the request was not drafting); the adaptive controller spaces out probes that need
        such a catch-up."""
        ...

    def draft_probs(self) -> dict[str, np.ndarray]:
        """The distributions the last `propose` drew sampled drafts from: request id -> q [drafts, vocab]
        (probabilistic drafting only: empty for deterministic drafts, which the coupled rule verifies)."""
        ...

    def release(self, request_id: str, finished: bool) -> None:
        """Forget per-request state. `finished` is False for a preemption (the request comes back)."""
        ...
