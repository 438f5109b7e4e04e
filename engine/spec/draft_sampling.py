"""Drafts drawn by a model drafter (`draft_sample_method: probabilistic`): sampled requests draw from the
drafter's distribution q, kept for the rejection rule; greedy ones keep the argmax."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.cpu.host import int_list
from engine.sampler import draft_sample
from engine.spec.proposer import DraftRequest


def samples(request: DraftRequest, probabilistic: bool) -> bool:
    """Whether this request's drafts are drawn rather than taken as the argmax."""
    return probabilistic and request.params is not None and not request.params.is_greedy


class DraftDraws:
    """One `propose` call's draws: tokens per pass, and each sampled request's q rows."""

    def __init__(self, vocab_size: int, head_token_ids: mx.array | None = None) -> None:
        """`vocab_size`: the target's logit width; `head_token_ids`: each drafter column's token id where it
        scores a reduced vocabulary."""
        self.vocab_size = vocab_size
        self.head_ids = np.asarray(head_token_ids) if head_token_ids is not None else None
        self.rows: dict[str, list[np.ndarray]] = {}

    def choose(self, logits: mx.array, requests: list[DraftRequest], step: int,
               probabilistic: list[bool]) -> list[int]:
        """logits [n, columns] of draft pass `step` -> one token id per row, drawn where `probabilistic`."""
        tokens = int_list(mx.argmax(logits, axis=-1))
        drawn = [i for i, p in enumerate(probabilistic) if p]
        if drawn:
            params = [requests[i].params for i in drawn]
            positions = [len(requests[i].token_ids) - requests[i].num_prompt_tokens + step for i in drawn]
            toks, q = draft_sample(logits[mx.array(drawn)], params, positions)  # type: ignore[arg-type]
            for j, i in enumerate(drawn):
                tokens[i] = toks[j]
                self.rows.setdefault(requests[i].request_id, []).append(self._widen(q[j]))
        if self.head_ids is not None:
            tokens = [int(self.head_ids[t]) for t in tokens]
        return tokens

    def _widen(self, q: np.ndarray) -> np.ndarray:
        """A q row over the drafter's columns -> over the target's vocabulary (zero elsewhere)."""
        if self.head_ids is None and q.shape[0] == self.vocab_size:
            return q
        out = np.zeros(self.vocab_size, dtype=np.float32)
        if self.head_ids is None:
            n = min(q.shape[0], self.vocab_size)
            out[:n] = q[:n]
        else:
            out[self.head_ids] = q
        return out

    def result(self, lengths: dict[str, int]) -> dict[str, np.ndarray]:
        """request id -> q [drafts, vocab] for sampled requests, cut to `lengths`."""
        return {rid: np.stack(rows[: lengths[rid]]) for rid, rows in self.rows.items()
                if lengths.get(rid, 0) > 0}
