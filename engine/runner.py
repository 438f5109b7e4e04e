"""The model runner: owns every array. SchedulerOutput in, RunnerOutput (plain lists) out."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.attention.reference import paged_attention_reference
from engine.attention.types import AttentionMetadata, build_metadata
from engine.cpu.bitmask import apply_bitmask
from engine.cpu.host import host_view, int_list
from engine.cpu.layers import CpuLayerStack
from engine.faults import NO_FAULTS, FaultHooks
from engine.kv.cache import PagedKVCache
from engine.models import adapter
from engine.sampling import TokenLogprob
from engine.spec.rejection import RejectionConfig
from engine.spec.verify import argmax_verifies, verify
from engine.step import FeatureRows, HiddenRow, RunnerOutput, SchedulerOutput
from engine.tensor_parallel.group import TensorParallel


def apply_grammar_masks(host: np.ndarray, so: SchedulerOutput, lazy: list[bool]) -> None:
    """Every token a row's grammar forbids to -inf, in place (copying costs more), except for `lazy`
    requests, decided by their argmax and masked only where it is not allowed."""
    row = 0
    for sr, skip in zip(so.scheduled, lazy, strict=True):
        n = sr.num_logits
        if sr.grammar is not None and n and not skip:
            apply_bitmask(host[row : row + n], sr.grammar.masks()[:n])
        row += n


class ModelRunner:
    # False masks every grammar row before verification (the structured-output tests' reference).
    lazy_grammar_masks = True

    def __init__(self, model: nn.Module, kv: PagedKVCache,
                 attention_fn: Callable[..., mx.array] = paged_attention_reference, *,
                 stack: CpuLayerStack | None = None, vocab_size: int | None = None,
                 rejection: RejectionConfig | None = None, keep_hidden: bool = False,
                 aux_layers: tuple[int, ...] = (), tp: TensorParallel | None = None,
                 faults: FaultHooks = NO_FAULTS) -> None:
        """`stack`: the C decoder layers where they apply; `rejection`: the rule for sampled drafts;
        `keep_hidden`: return each request's hidden row (MTP); `aux_layers`: return these layers' inputs
        (EAGLE-3's features); `tp`: rank 0 sends each forward's chunks to the others."""
        self.model = model
        self.kv = kv
        self.stack = stack
        self.vocab_size = vocab_size
        self.rejection = rejection or RejectionConfig()
        self.keep_hidden = keep_hidden
        self.aux_layers = aux_layers
        self._features: mx.array | None = None  # the last forward's aux rows [T, n_aux * hidden]
        self.tp = tp
        self.faults = faults
        adapter.install(model)
        self.caches = adapter.make_caches(model, kv)
        for c in self.caches:
            c.attention_fn = attention_fn

    def forward_chunks(self, chunks: list[tuple[list[int], int, list[int], int]]) -> mx.array:
        """chunks: per request (token_ids, start_pos, block_table, num_logits), in batch order -> the final
        hidden states of the logit rows [N, hidden]."""
        tp = self.tp
        if tp is not None and tp.leader:
            tp.send_forward(chunks)
        meta = build_metadata([(start, len(toks), table) for toks, start, table, _ in chunks],
                              self.kv.block_size)
        for c in self.caches:
            c.meta = meta
        tokens: list[int] = []
        rows: list[int] = []
        for toks, _, _, num_logits in chunks:
            tokens.extend(toks)
            rows.extend(range(len(tokens) - num_logits, len(tokens)))
        try:
            ids = mx.array(tokens, dtype=mx.int32)
            if self.aux_layers:
                h, self._features = self._hidden_and_features(ids, meta)
            elif self.stack is not None:
                h = self.stack.hidden_states(ids, meta)
            else:
                h = adapter.hidden_states(self.model, ids, self.caches)  # [T, hidden]
            if tp is not None:
                mx.eval(h)  # every rank runs the step's all-sums here, in the same order
        finally:
            for c in self.caches:
                c.meta = None
        return h[mx.array(rows, dtype=mx.int32)]

    def _hidden_and_features(self, ids: mx.array, meta: AttentionMetadata) -> tuple[mx.array, mx.array]:
        if self.stack is not None:
            return self.stack.hidden_states(ids, meta, aux_layers=self.aux_layers)
        return adapter.hidden_states(self.model, ids, self.caches, aux_layers=self.aux_layers)

    def greedy_tokens(self, h: mx.array) -> list[int]:
        """h: [N, hidden] -> argmax token per row."""
        return int_list(mx.argmax(adapter.compute_logits(self.model, h), axis=-1))

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.faults.raise_if("raise_in_forward", (sr.prompt_token_ids for sr in so.scheduled))
        h = self.forward_chunks([(sr.token_ids, sr.start_pos, sr.block_table, sr.num_logits)
                                 for sr in so.scheduled])
        logits = adapter.compute_logits(self.model, h).astype(mx.float32)  # [N, vocab]
        logits = self._inject_nan(so, logits)
        # NumPy reads the logits in place: one finiteness check, so a request with NaN/inf logits fails alone.
        host = host_view(mx.contiguous(logits)) if logits.shape[0] else np.zeros(logits.shape, np.float32)
        finite = cast("list[bool]", np.isfinite(host).all(axis=-1).tolist())  # one bool per row
        lazy = [sr.grammar is not None and self.lazy_grammar_masks
                and argmax_verifies(sr.params, self.rejection) for sr in so.scheduled]
        if any(sr.grammar is not None for sr in so.scheduled):
            apply_grammar_masks(host, so, lazy)
        out = RunnerOutput()
        row = 0
        for sr, (toks, lps) in zip(so.scheduled, verify(logits, host, so.scheduled, self.rejection, lazy),
                                   strict=True):
            bad = sr.num_logits > 0 and not all(finite[row : row + sr.num_logits])
            row += sr.num_logits
            out.errors.append("non-finite logits (NaN or inf) in this request's rows" if bad else None)
            out.sampled_token_ids.append(toks)
            # A request's rows share its params: every row has a logprob or none has.
            out.logprobs.append(cast("list[TokenLogprob]", lps) if lps and lps[0] is not None else None)
            out.num_accepted_drafts.append(max(0, len(toks) - 1))
        self._check_tokens(so, out)
        out.hidden = self._hidden_rows(so, h, out) if self.keep_hidden else [None] * len(so.scheduled)
        out.features = self._feature_rows(so, out) if self.aux_layers else [None] * len(so.scheduled)
        return out

    def _feature_rows(self, so: SchedulerOutput, out: RunnerOutput) -> list[FeatureRows | None]:
        """Each request's features of the positions this step confirmed (rejected drafts' rows dropped)."""
        feats, self._features = self._features, None
        assert feats is not None
        rows: list[FeatureRows | None] = []
        row = 0
        for sr, toks, err in zip(so.scheduled, out.sampled_token_ids, out.errors, strict=True):
            n = len(sr.token_ids)
            kept = n if sr.num_logits == 0 else n - (sr.num_logits - len(toks))
            rows.append(FeatureRows(sr.start_pos, feats[row : row + kept])
                        if err is None and kept > 0 and (toks or sr.num_logits == 0) else None)
            row += n
        return rows

    @staticmethod
    def _hidden_rows(so: SchedulerOutput, h: mx.array, out: RunnerOutput) -> list[HiddenRow | None]:
        """Each request's hidden row that produced its newest token (the MTP input)."""
        hidden: list[HiddenRow | None] = []
        row = 0
        for sr, toks in zip(so.scheduled, out.sampled_token_ids, strict=True):
            n = sr.num_logits
            pos = sr.start_pos + len(sr.token_ids) - n + len(toks)
            hidden.append(HiddenRow(pos, h[row + len(toks) - 1]) if n > 0 and toks else None)
            row += n
        return hidden

    def _inject_nan(self, so: SchedulerOutput, logits: mx.array) -> mx.array:
        if "nan_logits" not in self.faults.rules:
            return logits
        hits = self.faults.rows("nan_logits", (sr.prompt_token_ids for sr in so.scheduled))
        rows: list[bool] = []
        for sr, hit in zip(so.scheduled, hits, strict=True):
            rows += [hit] * sr.num_logits
        if not any(rows):
            return logits
        return mx.where(mx.array(rows)[:, None], mx.array(float("nan")), logits)

    def _check_tokens(self, so: SchedulerOutput, out: RunnerOutput) -> None:
        """Fail (only) a request whose new token ids fall outside the vocabulary."""
        bad_token = self.faults.rows("bad_token", (sr.prompt_token_ids for sr in so.scheduled))
        for i, hit in enumerate(bad_token):
            toks = out.sampled_token_ids[i]
            if hit and toks:
                toks[-1] = (self.vocab_size or 0) + 7
            if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in toks):
                out.errors[i] = out.errors[i] or f"sampled token ids {toks} fall outside the vocabulary"
                out.sampled_token_ids[i] = []
