"""The model runner: owns every array. SchedulerOutput in, RunnerOutput (plain lists) out."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.attention.reference import paged_attention_reference
from engine.attention.types import build_metadata
from engine.cpu.bitmask import apply_bitmask
from engine.cpu.host import host_view
from engine.cpu.layers import CpuLayerStack
from engine.distributed import TensorParallel
from engine.faults import FaultInjector, InjectedFault
from engine.kv.cache import PagedKVCache
from engine.models import adapter
from engine.sampler import VERIFY_STREAM, row_uniforms, sample, target_probs, token_logprobs
from engine.sampling import RowState, TokenLogprob
from engine.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput
from engine.spec.rejection import RejectionConfig, verify_sampled
from engine.spec.verify import verify_greedy, verify_greedy_constrained


def apply_grammar_masks(host: np.ndarray, so: SchedulerOutput, counts: list[int], lazy: list[bool]) -> None:
    """Every token a row's grammar forbids to -inf, in place in the step's logits (structured outputs: the
    sampler and the rejection rules read the masked rows), except for the requests marked `lazy`, whose
    rows are decided by their argmax and masked only where it is not allowed. In place because the logits
    are this step's own buffer, read by nothing else, and copying them costs more than the masks."""
    row = 0
    for sr, n, skip in zip(so.scheduled, counts, lazy, strict=True):
        if sr.grammar is not None and n and not skip:
            apply_bitmask(host[row : row + n], sr.grammar.masks()[:n])
        row += n


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
        # Speculation's verification rule (set by the engine) and the drafter's distributions of the
        # drafts now being verified, for probabilistic drafters: request id -> q [K, vocab].
        self.rejection = RejectionConfig()
        self.draft_probs: dict[str, np.ndarray] = {}
        # Structured outputs: rows decided by their argmax get a grammar mask only where the argmax is not
        # allowed (the same tokens; False masks every row first, the reference the tests compare with).
        self.lazy_grammar_masks = True
        # The decoder layers in one C call (engine/cpu/layers.py), set by the engine where it applies.
        self.stack: CpuLayerStack | None = None
        # Tensor parallelism (engine/distributed.py): rank 0 sends each forward's chunks to the others.
        self.tp: TensorParallel | None = None
        adapter.install(model)
        self.caches = adapter.make_caches(model, kv)
        for c in self.caches:
            c.attention_fn = attention_fn

    def forward_chunks(self, chunks: list[tuple[list[int], int, list[int], int]]) -> mx.array:
        """chunks: per request (token_ids, start_pos, block_table, num_logits), in batch order.
        Runs the flat batch and returns the final hidden states of the logit rows [N, hidden]."""
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
            if self.stack is not None:
                h = self.stack.hidden_states(ids, meta)
            else:
                h = adapter.hidden_states(self.model, ids, self.caches)  # [T, hidden]
            if tp is not None:
                mx.eval(h)  # every rank runs the step's all-sums here, in the same order
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
        # garbage (or an out-of-range id) into its output. On the host: NumPy reads the evaluated logits
        # in place, where MLX's CPU ops cost ~0.2 ms each per step.
        host = host_view(mx.contiguous(logits)) if logits.shape[0] else np.zeros(logits.shape, np.float32)
        finite = np.isfinite(host).all(axis=-1).tolist()
        lazy = [sr.grammar is not None and self.lazy_grammar_masks and self._argmax_verifies(sr)
                for sr in so.scheduled]
        if any(sr.grammar is not None for sr in so.scheduled):
            apply_grammar_masks(host, so, counts, lazy)

        out = RunnerOutput()
        # Rows by how they are decided: argmax-only verification (greedy, nothing position-dependent) in
        # one reduction; everything else through the sampler, a verifying request contributing one row per
        # position whose state holds its drafts so far (penalties, min_tokens and seeded keys then see
        # exactly what plain decoding would see there).
        argmax_rows: list[int] = []
        sample_rows: list[int] = []
        states: list[RowState] = []
        probs_rows: list[int] = []  # positions the rejection rules need whole distributions for
        probs_states: list[RowState] = []
        kinds: list[str] = []
        # The drafter's distributions of this step's drafts (probabilistic drafters only), taken now so
        # that none outlives its step whichever way its request is verified.
        qs = {sr.request_id: self.draft_probs.pop(sr.request_id) for sr in so.scheduled
              if sr.request_id in self.draft_probs}
        row = 0
        for sr, n in zip(so.scheduled, counts, strict=True):
            rows = range(row, row + n)
            row += n
            if n == 0:
                kinds.append("none")
            elif self._argmax_verifies(sr):
                kinds.append("argmax")
                argmax_rows.extend(rows)
            else:
                row_states = [RowState(params=sr.params,
                                       output_token_ids=sr.output_token_ids + sr.spec_token_ids[:i],
                                       prompt_token_ids=sr.prompt_token_ids, eos_token_ids=sr.eos_token_ids)
                              for i in range(n)]
                if n > 1 and (sr.request_id in qs or self.rejection.method != "standard"):
                    kinds.append("rejection")
                    probs_rows.extend(rows)
                    probs_states.extend(row_states)
                else:
                    kinds.append("sample")  # one token, or drafts checked against the sampled tokens
                    sample_rows.extend(rows)
                    states.extend(row_states)
        argmax_list = host[argmax_rows].argmax(axis=-1).tolist() if argmax_rows else []
        sampled = sample(logits[mx.array(sample_rows)], states) if sample_rows else None
        # Drafts with a q, or under a rule other than standard, go through engine/spec/rejection.py on whole
        # distributions; standard on deterministic drafts is the coupled check below, which needs none.
        rejected = self._verify_by_rejection(so, kinds, logits, probs_rows, probs_states, qs)

        si = ai = pi = row = 0
        for sr, n, kind, masks_later in zip(so.scheduled, counts, kinds, lazy, strict=True):
            base = row
            bad = n > 0 and not all(finite[row : row + n])
            row += n
            out.errors.append("non-finite logits (NaN or inf) in this request's rows" if bad else None)
            lps: list[TokenLogprob | None] = []
            if kind == "none":
                toks: list[int] = []
            elif kind == "argmax":
                if masks_later:
                    toks = verify_greedy_constrained(sr.spec_token_ids, argmax_list[ai : ai + n],
                                                     sr.grammar.allows, self._masked_argmax(host, base, sr))
                else:
                    toks = verify_greedy(sr.spec_token_ids, argmax_list[ai : ai + n])
                ai += n
            elif kind == "sample":
                assert sampled is not None
                # Drafts stand while they equal the token plain decoding draws there (the same processed
                # distribution and random draw): the output is plain sampled decoding's, token for token.
                toks = verify_greedy(sr.spec_token_ids, sampled.token_ids[si : si + n])
                lps = sampled.logprobs[si : si + len(toks)]
                si += n
            else:
                toks, lps = rejected[pi]
                pi += 1
            out.sampled_token_ids.append(toks)
            out.logprobs.append(lps if lps and lps[0] is not None else None)
            out.num_accepted_drafts.append(max(0, len(toks) - 1))
        self._check_tokens(so, out)
        if self.mtp_hidden is not None:
            self._keep_hidden(so, counts, h, out)
        return out

    @staticmethod
    def _masked_argmax(host: np.ndarray, base: int, sr: ScheduledRequest) -> Callable[[int], int]:
        """Row base + i's argmax once its grammar mask is applied (in place, as for eager rows)."""
        def argmax(i: int) -> int:
            rows = host[base + i : base + i + 1]
            apply_bitmask(rows, sr.grammar.mask(i))
            return int(rows[0].argmax())
        return argmax

    def _argmax_verifies(self, sr: ScheduledRequest) -> bool:
        """Drafts of this request are checked against the raw argmax (greedy, nothing position-dependent;
        the synthetic rule accepts whatever the target says, so it needs its own path)."""
        return sr.params.argmax_only and self.rejection.method != "synthetic"

    def _verify_by_rejection(self, so: SchedulerOutput, kinds: list[str], logits: mx.array, rows: list[int],
                             states: list[RowState], qs: dict[str, np.ndarray],
                             ) -> list[tuple[list[int], list[TokenLogprob | None]]]:
        """engine/spec/rejection.py's rule for each request of kind "rejection", in order: its tokens and,
        where asked, their logprobs."""
        if not rows:
            return []
        sub = logits[mx.array(rows)]  # [R, vocab]
        p = target_probs(sub, states)  # [R, vocab]
        uniforms = row_uniforms(states, VERIFY_STREAM)  # [R, 2]
        verifying = [sr for sr, kind in zip(so.scheduled, kinds, strict=True) if kind == "rejection"]
        tokens: list[list[int]] = []
        emitted: list[int] = []  # per row: the token whose logprob it reports
        r = 0
        for sr in verifying:
            k = len(sr.spec_token_ids)
            q = qs.get(sr.request_id)
            # The scheduler may have cut the drafts short (token budget, max_tokens): q's first rows remain.
            toks = verify_sampled(sr.spec_token_ids, p[r : r + k + 1],
                                  q[:k] if q is not None else None,
                                  uniforms[r : r + k + 1], self.rejection)
            tokens.append(toks)
            emitted.extend(toks + [toks[-1]] * (k + 1 - len(toks)))
            r += k + 1
        lps = token_logprobs(sub, states, emitted)  # all None unless a row asked
        results: list[tuple[list[int], list[TokenLogprob | None]]] = []
        r = 0
        for toks, sr in zip(tokens, verifying, strict=True):
            results.append((toks, lps[r : r + len(toks)]))
            r += len(sr.spec_token_ids) + 1
        return results

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
