"""Greedy draft verification: pure functions over plain lists (table-tested)."""

from __future__ import annotations

from collections.abc import Callable


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


def verify_greedy_constrained(draft_token_ids: list[int], target_argmax: list[int],
                              allows: Callable[[int, int], bool],
                              masked_argmax: Callable[[int], int]) -> list[int]:
    """`verify_greedy` under a grammar whose masks were not applied to the logits: `target_argmax[i]` is
    the unmasked argmax at position i, `allows(i, t)` whether position i's mask keeps t (then t is the
    masked argmax too: masking only lowers the other tokens, and ties still go to the lowest id), and
    `masked_argmax(i)` the masked argmax where it does not. Only the positions verification reaches are
    asked about, so the same tokens as `verify_greedy` over masked logits, with fewer masks."""
    if len(target_argmax) != len(draft_token_ids) + 1:
        raise ValueError("target_argmax must have one more entry than draft_token_ids")
    out: list[int] = []
    for i, target in enumerate(target_argmax):
        token = target if allows(i, target) else masked_argmax(i)
        out.append(token)
        if i == len(draft_token_ids) or token != draft_token_ids[i]:
            break
    return out
