"""Prompt-lookup (n-gram) drafting: find the longest earlier occurrence of the context's suffix
(length in [prompt_lookup_min, prompt_lookup_max]) and propose the tokens that followed it."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.spec.proposer import DraftRequest


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """tokens: [n] int. Longest suffix match wins; among equally long ones the one whose earlier tokens
    go on agreeing with the context longest (up to `_CONTEXT_CAP` more), then the most recent."""
    n = tokens.shape[0]
    if n < min_n + 1 or k < 1:
        return []
    # Vectorised per length, longest first: O(n * L) NumPy work per length, no Python loop over hits.
    for length in range(min(max_n, n - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: n - 1], length)  # [n - length, length]: each has a follower
        hits = np.flatnonzero((windows == tokens[n - length :]).all(axis=1))
        if hits.size:
            if hits.size > 1:
                hits = _longest_context(tokens, hits, n - length)
            follow = int(hits[-1]) + length
            return tokens[follow : follow + k].tolist()
    return []


# How far back ties between equally long matches are broken. A copy of a text with repeated phrases
# ("return a + b" / "return a - b") matches several places within prompt_lookup_max tokens; the one
# preceded by the same tokens as the context is the place being copied.
_CONTEXT_CAP = 64


def _longest_context(tokens: np.ndarray, starts: np.ndarray, end: int) -> np.ndarray:
    """starts: window starts of equally long matches of the suffix that begins at `end`. Keeps those
    whose preceding tokens agree with the ones before `end` for the most positions."""
    for j in range(1, min(_CONTEXT_CAP, end) + 1):
        before = starts - j
        ok = before >= 0
        ok[ok] = tokens[before[ok]] == tokens[end - j]
        if not ok.any():
            break
        starts = starts[ok]
        if starts.size == 1:
            break
    return starts


class NgramProposer:
    drafts_before_choice = True  # a lookup: cheap, and shorter drafts are prefixes of longer ones
    filters_drafts = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [find_ngram_draft(np.asarray(r.token_ids, dtype=np.int64), self.min_n, self.max_n,
                                 r.num_drafts) for r in requests]

    def catch_up_tokens(self, request: DraftRequest) -> int:
        return 0  # nothing to recompute before drafting

    def draft_probs(self) -> dict[str, np.ndarray]:
        return {}  # deterministic drafts

    def release(self, request_id: str, finished: bool) -> None:
        return None  # stateless
