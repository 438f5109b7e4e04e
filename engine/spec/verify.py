"""Greedy draft verification: a pure function over plain lists (table-tested)."""

from __future__ import annotations


def verify_greedy(draft_token_ids: list[int], target_argmax: list[int]) -> list[int]:
    """Tokens to append for one request.

    `target_argmax[i]` is the target's greedy token after the prefix ending at draft position i
    (i = 0 is the position of the last confirmed token), so len(target_argmax) == len(drafts) + 1.
    Drafts are accepted while they equal the target's choice; then the target's own token is
    emitted (a correction, or the bonus token when every draft was accepted). The result is always
    exactly what plain greedy decoding would produce, 1..K+1 tokens long.
    """
    if len(target_argmax) != len(draft_token_ids) + 1:
        raise ValueError("target_argmax must have one more entry than draft_token_ids")
    out: list[int] = []
    for draft, target in zip(draft_token_ids, target_argmax, strict=False):
        if draft != target:
            break
        out.append(draft)
    out.append(target_argmax[len(out)])
    return out
