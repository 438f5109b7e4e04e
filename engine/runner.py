"""The model runner: owns every array. SchedulerOutput in, RunnerOutput (plain lists) out."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.attention import PagedKVCache, build_metadata
from engine.models import adapter
from engine.sampling import RowState, sample
from engine.scheduler import RunnerOutput, SchedulerOutput
from engine.spec.verify import verify_greedy


class ModelRunner:
    def __init__(self, model: nn.Module, kv: PagedKVCache) -> None:
        self.model = model
        self.kv = kv
        adapter.install(model)
        windows = adapter.layer_windows(model)
        self.caches = [adapter.PagedLayerCache(kv, i, w) for i, w in enumerate(windows)]

    def forward(self, so: SchedulerOutput) -> tuple[mx.array, list[int]]:
        """Run the flat batch; return final hidden states of the rows that need logits
        ([N, hidden]) and, per scheduled request, how many of those rows it owns."""
        chunks = [(sr.start_pos, len(sr.token_ids), sr.block_table) for sr in so.scheduled]
        meta = build_metadata(chunks, self.kv.block_size)
        for c in self.caches:
            c.meta = meta
        tokens: list[int] = []
        rows: list[int] = []
        for sr in so.scheduled:
            off = len(tokens)
            tokens.extend(sr.token_ids)
            rows.extend(range(off + len(sr.token_ids) - sr.num_logits, off + len(sr.token_ids)))
        h = adapter.hidden_states(self.model, mx.array(tokens, dtype=mx.int32), self.caches)  # [T, hidden]
        for c in self.caches:
            c.meta = None
        return h[mx.array(rows, dtype=mx.int32)], [sr.num_logits for sr in so.scheduled]

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        h, counts = self.forward(so)
        logits = adapter.compute_logits(self.model, h).astype(mx.float32)  # [N, vocab]

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

        si = vi = 0
        for sr, n in zip(so.scheduled, counts, strict=True):
            out.errors.append(None)
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
        return out
