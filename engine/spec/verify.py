"""Draft verification: one call per step over its logits (`verify`), and the per-request rules it applies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.cpu.bitmask import apply_bitmask
from engine.sampler import VERIFY_STREAM, row_uniforms, sample, target_probs, token_logprobs
from engine.sampling import RowState, SamplingParams, TokenLogprob
from engine.spec.rejection import RejectionConfig, verify_sampled
from engine.step import ScheduledRequest


def accept_matching(draft_token_ids: list[int], target_tokens: list[int]) -> list[int]:
    """Tokens to append for one request (1..K+1): drafts while they equal the target's token there, then the
    target's own token. `target_tokens` has one entry more than the drafts."""
    if len(target_tokens) != len(draft_token_ids) + 1:
        raise ValueError("target_tokens must have one more entry than draft_token_ids")
    out: list[int] = []
    for draft, target in zip(draft_token_ids, target_tokens, strict=False):
        if draft != target:
            break
        out.append(draft)
    out.append(target_tokens[len(out)])
    return out


def accept_matching_constrained(draft_token_ids: list[int], target_argmax: list[int],
                                allows: Callable[[int, int], bool],
                                masked_argmax: Callable[[int], int]) -> list[int]:
    """`accept_matching` under an unapplied grammar mask: `target_argmax[i]` unmasked, `allows(i, t)` whether
    position i's mask keeps t, `masked_argmax(i)` where it does not (asked only where reached)."""
    if len(target_argmax) != len(draft_token_ids) + 1:
        raise ValueError("target_argmax must have one more entry than draft_token_ids")
    out: list[int] = []
    for i, target in enumerate(target_argmax):
        token = target if allows(i, target) else masked_argmax(i)
        out.append(token)
        if i == len(draft_token_ids) or token != draft_token_ids[i]:
            break
    return out


def argmax_verifies(params: SamplingParams, rule: RejectionConfig) -> bool:
    """Checked against the raw argmax: greedy, nothing position-dependent, not the synthetic rule."""
    return params.argmax_only and rule.method != "synthetic"


@dataclass(slots=True)
class _Rows:
    """Logits rows grouped by how they are decided, and each request's group."""

    kinds: list[str] = field(default_factory=list)  # per request: none, argmax, sample or rejection
    argmax: list[int] = field(default_factory=list)
    sample: list[int] = field(default_factory=list)
    sample_states: list[RowState] = field(default_factory=list)
    rejection: list[int] = field(default_factory=list)
    rejection_states: list[RowState] = field(default_factory=list)


def _group_rows(scheduled: list[ScheduledRequest], rule: RejectionConfig) -> _Rows:
    """A verifying request gets one row per position whose state holds its drafts so far, as plain decoding
    would see it."""
    g = _Rows()
    row = 0
    for sr in scheduled:
        n = sr.num_logits
        rows = range(row, row + n)
        row += n
        if n == 0:
            g.kinds.append("none")
            continue
        if argmax_verifies(sr.params, rule):
            g.kinds.append("argmax")
            g.argmax.extend(rows)
            continue
        states = [RowState(params=sr.params, output_token_ids=sr.output_token_ids + sr.spec_token_ids[:i],
                           prompt_token_ids=sr.prompt_token_ids, eos_token_ids=sr.eos_token_ids)
                  for i in range(n)]
        # Standard on deterministic drafts is the coupled check (drafts against the sampled tokens).
        if n > 1 and (sr.draft_probs is not None or rule.method != "standard"):
            g.kinds.append("rejection")
            g.rejection.extend(rows)
            g.rejection_states.extend(states)
        else:
            g.kinds.append("sample")
            g.sample.extend(rows)
            g.sample_states.extend(states)
    return g


Verified = tuple[list[int], list[TokenLogprob | None]]


def verify(logits: mx.array, host: np.ndarray, scheduled: list[ScheduledRequest], rule: RejectionConfig,
           lazy_masks: list[bool]) -> list[Verified]:
    """Per scheduled request, the tokens to append and their logprobs. `host`: the host view of `logits`
    [N, vocab], grammar masks applied except for `lazy_masks` requests."""
    g = _group_rows(scheduled, rule)
    argmax_list = host[g.argmax].argmax(axis=-1).tolist() if g.argmax else []
    sampled = sample(logits[mx.array(g.sample)], g.sample_states) if g.sample else None
    rejected = iter(_verify_by_rejection(scheduled, g, logits, rule))
    out: list[Verified] = []
    ai = si = row = 0
    for sr, kind, lazy in zip(scheduled, g.kinds, lazy_masks, strict=True):
        n, base = sr.num_logits, row
        row += n
        if kind == "none":
            out.append(([], []))
        elif kind == "argmax":
            targets = argmax_list[ai : ai + n]
            ai += n
            if lazy:
                assert sr.grammar is not None
                out.append((accept_matching_constrained(sr.spec_token_ids, targets, sr.grammar.allows,
                                                        _masked_argmax(host, base, sr)), []))
            else:
                out.append((accept_matching(sr.spec_token_ids, targets), []))
        elif kind == "sample":
            assert sampled is not None
            # The same processed distribution and draw as plain decoding: its output, token for token.
            toks = accept_matching(sr.spec_token_ids, sampled.token_ids[si : si + n])
            out.append((toks, sampled.logprobs[si : si + len(toks)]))
            si += n
        else:
            out.append(next(rejected))
    return out


def _masked_argmax(host: np.ndarray, base: int, sr: ScheduledRequest) -> Callable[[int], int]:
    """Row base + i's argmax once its grammar mask is applied (in place, as for eager rows)."""
    assert sr.grammar is not None
    grammar = sr.grammar

    def argmax(i: int) -> int:
        rows = host[base + i : base + i + 1]
        apply_bitmask(rows, grammar.mask(i))
        return int(rows[0].argmax())
    return argmax


def _verify_by_rejection(scheduled: list[ScheduledRequest], g: _Rows, logits: mx.array,
                         rule: RejectionConfig) -> list[Verified]:
    """engine/spec/rejection.py's rule for each request of kind "rejection", in order."""
    if not g.rejection:
        return []
    sub = logits[mx.array(g.rejection)]  # [R, vocab]
    p = target_probs(sub, g.rejection_states)  # [R, vocab]
    uniforms = row_uniforms(g.rejection_states, VERIFY_STREAM)  # [R, 2]
    verifying = [sr for sr, kind in zip(scheduled, g.kinds, strict=True) if kind == "rejection"]
    tokens: list[list[int]] = []
    emitted: list[int] = []  # per row: the token whose logprob it reports
    r = 0
    for sr in verifying:
        k = len(sr.spec_token_ids)
        q = sr.draft_probs
        # The scheduler may have cut the drafts short: q's first rows remain.
        toks = verify_sampled(sr.spec_token_ids, p[r : r + k + 1], q[:k] if q is not None else None,
                              uniforms[r : r + k + 1], rule)
        tokens.append(toks)
        emitted.extend(toks + [toks[-1]] * (k + 1 - len(toks)))
        r += k + 1
    lps = token_logprobs(sub, g.rejection_states, emitted)  # all None unless a row asked
    results: list[Verified] = []
    r = 0
    for toks, sr in zip(tokens, verifying, strict=True):
        results.append((toks, lps[r : r + len(toks)]))
        r += len(sr.spec_token_ids) + 1
    return results
