"""Prompt-lookup (n-gram) drafting: find the longest earlier occurrence of the context's suffix
(length in [prompt_lookup_min, prompt_lookup_max]) and propose the tokens that followed it."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.spec.proposer import DraftRequest


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """tokens: [n] int. Longest suffix match wins; among equally long ones the most recent."""
    n = tokens.shape[0]
    if n < min_n + 1 or k < 1:
        return []
    # Vectorised per length, longest first: O(n * L) NumPy work per length, no Python loop over hits.
    for length in range(min(max_n, n - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: n - 1], length)  # [n - length, length]: each has a follower
        hits = np.flatnonzero((windows == tokens[n - length :]).all(axis=1))
        if hits.size:
            follow = int(hits[-1]) + length
            return tokens[follow : follow + k].tolist()
    return []


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

    def release(self, request_id: str, finished: bool) -> None:
        return None  # stateless
