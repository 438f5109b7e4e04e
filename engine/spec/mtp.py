"""MTP proposer: an assistant drafts from the target's hidden row behind the newest token, attending over the
target's paged KV; K > 1 feeds its output back as the next hidden state. It writes no KV (nothing to roll
back)."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from engine.attention.types import build_metadata
from engine.cpu import mtp as mtp_cpu
from engine.cpu.host import bool_list, int_list, int_rows
from engine.kv.cache import PagedKVCache
from engine.models.loader import LoadedModel
from engine.models.mtp_assistant import LoadedAssistant, make_caches
from engine.spec.draft_sampling import DraftDraws, samples
from engine.spec.proposer import DraftRequest

logger = logging.getLogger("specserve.mtp")

# (index in the step's requests, request, query position, target hidden row)
_Active = tuple[int, DraftRequest, int, mx.array]


def top_token_prob(logits: mx.array) -> mx.array:
    """[N, V] logits -> [N]: the argmax's probability, compared with `min_token_prob`."""
    return mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1))


class MTPProposer:
    drafts_before_choice = False  # each draft token costs a forward: K is chosen first
    shares_target_blocks = False  # it reads the target's KV and writes none

    def __init__(self, assistant: LoadedAssistant, target: LoadedModel, kv: PagedKVCache,
                 min_token_prob: float | list[float] = 0.0, use_c: bool = True,
                 probabilistic: bool = False) -> None:
        """`probabilistic`: sampled requests' drafts are drawn from the assistant's distribution (the C passes
        then run one at a time)."""
        self.assistant = assistant
        self.probabilistic = probabilistic
        self.vocab_size = target.vocab_size
        self._probs: dict[str, np.ndarray] = {}
        # Cut-off per draft position; positions past the list use its last value.
        self.cuts = list(min_token_prob) if isinstance(min_token_prob, list) else [min_token_prob]
        self.kv = kv
        inner = target.model.model
        self.embed_tokens = inner.embed_tokens
        self.embed_scale = float(getattr(inner, "embed_scale", 1.0))
        # The C pass where it applies (engine/cpu/mtp.py); the MLX module otherwise.
        self.cpu: mtp_cpu.CpuAssistant | None = None
        self.cpu_reason = (mtp_cpu.unsupported_reason(assistant, kv, self.embed_tokens) if use_c
                           else "draft_backend: mlx")
        if self.cpu_reason is None:
            try:
                net = assistant.module
                self.cpu = mtp_cpu.CpuAssistant(net, self.embed_tokens, self.embed_scale)  # type: ignore[arg-type]
            except (RuntimeError, OSError) as e:  # no compiler, or the library does not load
                self.cpu_reason = f"C pass unavailable: {e}"
        logger.info("MTP assistant passes: %s", "C (engine/cpu/mtp.c)" if self.cpu is not None
                    else f"MLX ({self.cpu_reason})")

    @property
    def filters_drafts(self) -> bool:
        return any(c > 0 for c in self.cuts)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return self.draft(requests)[0]

    def draft_probs(self) -> dict[str, np.ndarray]:
        return self._probs

    def draft(self, requests: list[DraftRequest],
              keep_logits: bool = False) -> tuple[list[list[int]], list[mx.array]]:
        """Drafts per request, and (keep_logits) the assistant logits per step [N_active, head rows]."""
        self._probs = {}
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[_Active] = []
        for i, r in enumerate(requests):
            pos = len(r.token_ids) - 1
            # The hidden row must be the one that produced the newest token (else no drafts).
            if r.hidden is not None and r.hidden.position == pos >= 1 and r.block_table is not None:
                active.append((i, r, pos, r.hidden.row))
        if not active:
            return drafts, []
        drawn = [samples(r, self.probabilistic) for _, r, _, _ in active]
        if self.cpu is not None and not keep_logits:
            self._draft_cpu(active, drafts, drawn)
            return drafts, []
        kv = self.kv
        # Queries sit at `pos`; the mask is built one position earlier, so keys stop at pos - 1 (the newest
        # token has no target KV yet).
        meta = build_metadata([(pos - 1, 1, r.block_table or []) for _, r, pos, _ in active], kv.block_size)
        positions = meta.positions + 1  # [N] query positions (RoPE)
        caches = make_caches(self.assistant, kv, meta)
        toks = mx.array([r.token_ids[-1] for _, r, _, _ in active], dtype=mx.int32)
        hidden = mx.stack([h for _, _, _, h in active])  # [N, backbone]
        k_max = max(r.num_drafts for _, r, _, _ in active)
        ids = self.assistant.head_token_ids
        draws = DraftDraws(self.vocab_size, ids) if any(drawn) else None
        steps: list[mx.array] = []
        all_logits: list[mx.array] = []
        sure: list[mx.array] = []  # per step [N]: every draft token so far clears min_token_prob
        for j in range(k_max):
            embeds = self.embed_tokens(toks) * self.embed_scale
            x = mx.concatenate([embeds.astype(hidden.dtype), hidden], axis=-1)  # [N, 2 * backbone]
            logits, hidden = self.assistant.module(x, positions, caches)
            if draws is not None:
                toks = mx.array(draws.choose(logits, [r for _, r, _, _ in active], j, drawn), dtype=mx.int32)
            else:
                toks = mx.argmax(logits, axis=-1).astype(mx.int32)
                if ids is not None:
                    toks = ids[toks]
            steps.append(toks)
            if keep_logits:
                all_logits.append(logits)
            if self.filters_drafts:
                ok = top_token_prob(logits) >= self.cuts[min(j, len(self.cuts) - 1)]
                sure.append(ok if not sure else sure[-1] & ok)
                if j + 1 < k_max and not mx.any(sure[-1]).item():
                    break  # every draft has ended: no more assistant passes
        tokens = mx.stack(steps, axis=1)  # [N, steps run]
        counts = mx.stack(sure, axis=1).sum(axis=1) if sure else mx.full((len(active),), len(steps))
        mx.eval(tokens, counts)  # one evaluation for both
        out, lengths = int_rows(tokens), int_list(counts)
        for (i, r, _, _), row, n in zip(active, out, lengths, strict=True):
            drafts[i] = row[: min(r.num_drafts, int(n))]
        if draws is not None:
            self._probs = draws.result({r.request_id: len(drafts[i]) for i, r, _, _ in active})
        return drafts, all_logits

    def _draft_cpu(self, active: list[_Active], drafts: list[list[int]], drawn: list[bool]) -> None:
        """`draft` through the C passes, with the same cut-offs and early stop; one call runs every pass
        unless a request draws its drafts (then one pass at a time)."""
        assert self.cpu is not None
        draws_of = {a[0]: d for a, d in zip(active, drawn, strict=True)}
        kv = self.kv
        # The C loop reads keys without bounds checks: a table too short for its position gets no drafts.
        active = [a for a in active if a[2] <= len(a[1].block_table or []) * kv.block_size]
        if not active:
            return
        reqs = [r for _, r, _, _ in active]
        tables = np.zeros((len(reqs), max(len(r.block_table or []) for r in reqs)), dtype=np.int32)
        for row, r in enumerate(reqs):
            assert r.block_table is not None  # `draft` keeps only requests with a block table
            tables[row, : len(r.block_table)] = r.block_table
        hidden = np.asarray(mx.stack([h for _, _, _, h in active]).astype(mx.float32))
        keys, values = kv.blocks(self.assistant.target_layers[0])
        positions = [p for _, _, p, _ in active]
        if not any(draws_of[i] for i, _, _, _ in active):
            out = self.cpu.draft([r.token_ids[-1] for r in reqs], hidden, positions, tables, kv.block_size,
                                 keys, values, self.cuts, [r.num_drafts for r in reqs])
            for (i, _, _, _), d in zip(active, out, strict=True):
                drafts[i] = d
            return
        draws = DraftDraws(self.vocab_size, self.assistant.head_token_ids)
        hidden = np.array(hidden)  # the passes overwrite it
        toks = [r.token_ids[-1] for r in reqs]
        going = list(range(len(reqs)))  # rows still drafting
        for j in range(max(r.num_drafts for r in reqs)):
            rows_hidden = np.ascontiguousarray(hidden[going])  # [g, backbone], the next rows in place
            logits = mx.array(self.cpu.step([toks[g] for g in going], rows_hidden,
                                            [positions[g] for g in going], tables[going], kv.block_size,
                                            keys, values))  # [g, head_size]
            hidden[going] = rows_hidden
            chosen = draws.choose(logits, [reqs[g] for g in going], j,
                                  [draws_of[active[g][0]] for g in going])
            sure = bool_list(top_token_prob(logits) >= self.cuts[min(j, len(self.cuts) - 1)])
            still = []
            for g, t, ok in zip(going, chosen, sure, strict=True):
                if not ok:
                    continue  # its draft ends before this token
                drafts[active[g][0]].append(t)
                toks[g] = t
                if len(drafts[active[g][0]]) < reqs[g].num_drafts:
                    still.append(g)
            if not still:
                break
            going = still
        self._probs = draws.result({r.request_id: len(drafts[i]) for i, r, _, _ in active})

    def catch_up_tokens(self, request: DraftRequest) -> int:
        return 0  # nothing to recompute before drafting

    def release(self, request_id: str, finished: bool) -> None:
        pass  # the hidden rows ride on the draft requests: nothing kept here
