"""The model runner: owns every array. SchedulerOutput in, RunnerOutput (plain lists) out."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from engine.attention.reference import paged_attention_reference
from engine.attention.types import build_metadata
from engine.faults import FaultInjector, InjectedFault
from engine.kv.cache import PagedKVCache
from engine.models import adapter
from engine.sampler import sample
from engine.sampling import RowState
from engine.scheduler import RunnerOutput, SchedulerOutput
from engine.spec.verify import verify_greedy


class ModelRunner:
    def __init__(self, model: nn.Module, kv: PagedKVCache,
                 attention_fn: Callable[..., mx.array] = paged_attention_reference,
                 faults: FaultInjector | None = None) -> None:
        self.model = model
        self.kv = kv
        self.faults = faults
        self.vocab_size: int | None = None  # set by the engine: sampled ids are checked against it
        # MTP: request id -> (position of its newest token, target hidden row that produced it [hidden]).
        self.mtp_hidden: dict[str, tuple[int, mx.array]] | None = None
        adapter.install(model)
        windows = adapter.layer_windows(model)
        self.caches = [adapter.PagedLayerCache(kv, i, w) for i, w in enumerate(windows)]
        for c in self.caches:
            c.attention_fn = attention_fn

    def forward_chunks(self, chunks: list[tuple[list[int], int, list[int], int]]) -> mx.array:
        """chunks: per request (token_ids, start_pos, block_table, num_logits), in batch order.
        Runs the flat batch and returns the final hidden states of the logit rows [N, hidden]."""
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
            h = adapter.hidden_states(self.model, ids, self.caches)  # [T, hidden]
        finally:
            for c in self.caches:
                c.meta = None
        return h[mx.array(rows, dtype=mx.int32)]

    def greedy_tokens(self, h: mx.array) -> list[int]:
        """h: [N, hidden] -> argmax token per row."""
        return mx.argmax(adapter.compute_logits(self.model, h), axis=-1).tolist()

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        faults = self.faults
        if faults is not None and any(faults.hits("raise_in_forward", sr.prompt_token_ids)
                                      for sr in so.scheduled):
            raise InjectedFault("injected fault: raise_in_forward")
        h = self.forward_chunks([(sr.token_ids, sr.start_pos, sr.block_table, sr.num_logits)
                                 for sr in so.scheduled])
        counts = [sr.num_logits for sr in so.scheduled]
        logits = adapter.compute_logits(self.model, h).astype(mx.float32)  # [N, vocab]
        if faults is not None:
            logits = self._inject_nan(so, counts, logits)
        # One reduction per step: a request whose logits went NaN/inf fails alone, instead of sampling
        # garbage (or an out-of-range id) into its output.
        finite = mx.all(mx.isfinite(logits), axis=-1).tolist() if logits.shape[0] else []

        out = RunnerOutput()
        # Requests verifying drafts are greedy: all their rows reduce to argmax.
        verify_rows: list[int] = []
        sample_rows: list[int] = []
        row_states: list[RowState] = []
        row = 0
        for sr, n in zip(so.scheduled, counts, strict=True):
            if n > 1:
                verify_rows.extend(range(row, row + n))
            elif n == 1:
                sample_rows.append(row)
                row_states.append(RowState(params=sr.params, output_token_ids=sr.output_token_ids,
                                           prompt_token_ids=sr.prompt_token_ids,
                                           eos_token_ids=sr.eos_token_ids))
            row += n
        argmax = mx.argmax(logits[mx.array(verify_rows)], axis=-1) if verify_rows else None
        sampled = sample(logits[mx.array(sample_rows)], row_states) if sample_rows else None
        argmax_list = argmax.tolist() if argmax is not None else []

        si = vi = row = 0
        for sr, n in zip(so.scheduled, counts, strict=True):
            bad = n > 0 and not all(finite[row : row + n])
            row += n
            out.errors.append("non-finite logits (NaN or inf) in this request's rows" if bad else None)
            if n == 0:
                out.sampled_token_ids.append([])
                out.logprobs.append(None)
                out.num_accepted_drafts.append(0)
            elif n == 1:
                assert sampled is not None
                out.sampled_token_ids.append([sampled.token_ids[si]])
                lp = sampled.logprobs[si]
                out.logprobs.append([lp] if lp is not None else None)
                out.num_accepted_drafts.append(0)
                si += 1
            else:
                toks = verify_greedy(sr.spec_token_ids, argmax_list[vi : vi + n])
                out.sampled_token_ids.append(toks)
                out.logprobs.append(None)
                out.num_accepted_drafts.append(len(toks) - 1)
                vi += n
        self._check_tokens(so, out)
        if self.mtp_hidden is not None:
            self._keep_hidden(so, counts, h, out)
        return out

    def _keep_hidden(self, so: SchedulerOutput, counts: list[int], h: mx.array, out: RunnerOutput) -> None:
        """Remember each request's hidden row that produced its newest token (the MTP input)."""
        assert self.mtp_hidden is not None
        row = 0
        for sr, n, toks in zip(so.scheduled, counts, out.sampled_token_ids, strict=True):
            if n > 0 and toks:
                pos = sr.start_pos + len(sr.token_ids) - n + len(toks)
                self.mtp_hidden[sr.request_id] = (pos, h[row + len(toks) - 1])
            row += n

    def _inject_nan(self, so: SchedulerOutput, counts: list[int], logits: mx.array) -> mx.array:
        assert self.faults is not None
        rows: list[bool] = []
        for sr, n in zip(so.scheduled, counts, strict=True):
            rows += [self.faults.hits("nan_logits", sr.prompt_token_ids)] * n
        if not any(rows):
            return logits
        return mx.where(mx.array(rows)[:, None], mx.array(float("nan")), logits)

    def _check_tokens(self, so: SchedulerOutput, out: RunnerOutput) -> None:
        """Fail (only) a request whose new token ids fall outside the vocabulary."""
        for i, sr in enumerate(so.scheduled):
            toks = out.sampled_token_ids[i]
            if self.faults is not None and toks and self.faults.hits("bad_token", sr.prompt_token_ids):
                toks[-1] = (self.vocab_size or 0) + 7
            if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in toks):
                out.errors[i] = out.errors[i] or f"sampled token ids {toks} fall outside the vocabulary"
                out.sampled_token_ids[i] = []
