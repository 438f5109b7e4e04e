"""Prompt-lookup (n-gram) drafting: find the longest earlier occurrence of the context's suffix
(length in [prompt_lookup_min, prompt_lookup_max]) and propose the tokens that followed it."""

from __future__ import annotations

import numpy as np

from engine.spec.proposer import DraftRequest


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """tokens: [n] int. The longest suffix match wins; ties go to the one agreeing with the context longest
    further back (up to `_CONTEXT_CAP`), then the most recent."""
    n = tokens.shape[0]
    if n < min_n + 1 or k < 1:
        return []
    # Match ends: earlier positions holding the last token, kept while the match extends one further back.
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    longest = min(max_n, n - 1)
    length, best, best_len = 1, ends[:0], 0
    while ends.size:
        if length >= min_n:
            best, best_len = ends, length
        if length == longest:
            break
        ends = _extend(tokens, ends, length)
        length += 1
    if not best.size:
        return []
    ends, length = best, best_len
    # Ties: the match agreeing with the context the longest is the place being copied.
    for back in range(length, length + min(_CONTEXT_CAP, n - length)):
        if ends.size == 1:
            break
        agree = _extend(tokens, ends, back)
        if not agree.size:
            break
        ends = agree
    follow = int(ends[-1]) + 1
    return tokens[follow : follow + k].tolist()


# How far back ties between equally long matches are broken.
_CONTEXT_CAP = 64


def _extend(tokens: np.ndarray, ends: np.ndarray, back: int) -> np.ndarray:
    """The match ends whose token `back` places before equals the one `back` before the context's last."""
    ends = ends[ends >= back]
    return ends[tokens[ends - back] == tokens[tokens.shape[0] - 1 - back]]


class NgramProposer:
    drafts_before_choice = True  # a lookup
    filters_drafts = False
    shares_target_blocks = False

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
