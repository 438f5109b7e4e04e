"""Prompt-lookup (n-gram) drafting: find the longest earlier occurrence of the context's suffix
(length in [prompt_lookup_min, prompt_lookup_max]) and propose the tokens that followed it."""

from __future__ import annotations

import numpy as np

from engine.spec.proposer import DraftRequest


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """tokens: [n] int. Longest suffix match wins; among equally long ones the one whose earlier tokens
    go on agreeing with the context longest (up to `_CONTEXT_CAP` more), then the most recent."""
    n = tokens.shape[0]
    if n < min_n + 1 or k < 1:
        return []
    # Match ends: earlier positions holding the last token, each with a follower. Each pass keeps the
    # ends whose match extends one token further back: one compare over the context, then a few over the
    # (few) ends, instead of a window compare over the context per length (it runs per request per step).
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
    # Ties: the match whose earlier tokens agree with the context's for the most positions is the place
    # being copied (a text with repeated phrases matches several places within prompt_lookup_max tokens).
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
    """The match ends whose token `back` places before them equals the one `back` before the context's
    last token."""
    ends = ends[ends >= back]
    return ends[tokens[ends - back] == tokens[tokens.shape[0] - 1 - back]]


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
