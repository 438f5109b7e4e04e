"""Speculative decoding as one object: proposer, K controls, back-off, the adaptive controller and draft
bookkeeping; the core calls `observe` before the update, `propose` after the outputs."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from engine.faults import NO_FAULTS, FaultHooks
from engine.kv.block_manager import KVCacheManager
from engine.kv.cache import PagedKVCache
from engine.models.loader import LoadedModel
from engine.request import Request, RequestStatus
from engine.sampling import temperature_bucket
from engine.spec.adaptive import AdaptiveController, Candidate
from engine.spec.backoff import DraftBackoff
from engine.spec.config import SpeculativeConfig
from engine.spec.factory import Draft, build_proposer
from engine.spec.proposer import DraftRequest, Proposer
from engine.stats import IterationStats, SpecDecodingStats
from engine.step import FeatureRows, HiddenRow, RunnerOutput, SchedulerOutput
from engine.structured import StructuredOutputManager

logger = logging.getLogger(__name__)
# Catch-up rows past which they run before the timed draft call (more than a decode step confirms).
LONG_CATCH_UP = 8


class SpecDecoding:
    def __init__(self, spec: SpeculativeConfig, draft: Draft | None, draft_blocks: int, block_size: int,
                 target: LoadedModel, kv_cache: PagedKVCache, attention_fn: Callable[..., Any], max_len: int,
                 structured: StructuredOutputManager, faults: FaultHooks = NO_FAULTS) -> None:
        """`max_len`: the last position drafts may reach; `structured`: drafts are fitted to grammars."""
        self.spec = spec
        self.max_len = max_len
        self.structured = structured
        self.faults = faults
        self.proposer: Proposer = build_proposer(spec, draft, draft_blocks, block_size, target, kv_cache,
                                                 attention_fn)
        # The target's hidden row behind each request's newest token (MTP).
        self.hidden: dict[str, HiddenRow] = {}
        # EAGLE-3: the target features this step confirmed, until propose hands them to the proposer.
        self.features: dict[str, list[FeatureRows]] = {}
        self.backoff = DraftBackoff()
        self.adaptive: AdaptiveController | None = None
        if spec.adaptive is not None:
            a = spec.adaptive
            self.adaptive = AdaptiveController(
                spec.num_speculative_tokens, ema=a.acceptance_ema, base_probe=a.probe_interval,
                gate_probes=not self.proposer.drafts_before_choice)
        logger.info("speculative decoding: %s, num_speculative_tokens=%s%s", spec.method,
                    f"auto (up to {spec.num_speculative_tokens})" if spec.adaptive
                    else spec.num_speculative_tokens,
                    "" if draft is None else f", draft {draft.path}, its KV "
                    + ("at the target's block ids" if self.proposer.shares_target_blocks
                       else f"cache {draft_blocks} blocks"))
        rule = spec.rejection
        if rule.method == "synthetic":
            logger.warning("speculative decoding: SYNTHETIC acceptance (benchmarking only): every draft is "
                           "accepted with probability %s whatever it is; outputs are NOT the model's",
                           rule.synthetic_acceptance_rate)
        elif rule.method == "typical":
            logger.warning("speculative decoding: LOSSY typical acceptance (posterior_threshold=%s, "
                           "posterior_alpha=%s): sampled outputs no longer follow the model's distribution",
                           rule.posterior_threshold, rule.posterior_alpha)

    def _observe_step(self, so: SchedulerOutput, seconds: float) -> None:
        """The step's cost, for the adaptive controller's rate model."""
        if self.adaptive is None:
            return
        if so.decode_only:
            # Decode/verify steps only: prefill is far cheaper per token than draft rows.
            drafting = sum(1 for sr in so.scheduled if len(sr.token_ids) > 1)
            self.adaptive.observe_step(so.num_batched_tokens, seconds, len(so.scheduled), drafting)
        else:
            self.adaptive.skip_step()

    def _preempted(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.hidden.pop(rid, None)
            self.features.pop(rid, None)
            self.proposer.release(rid, finished=False)

    def observe(self, so: SchedulerOutput, res: RunnerOutput,
                requests: dict[str, Request]) -> SpecDecodingStats:
        """Count this step's verifications (before the update, so finishing requests count theirs)."""
        st = SpecDecodingStats()
        for sr, hidden in zip(so.scheduled, res.hidden, strict=True):
            if hidden is not None:
                self.hidden[sr.request_id] = hidden
        for sr, feats in zip(so.scheduled, res.features or [None] * len(so.scheduled), strict=True):
            if feats is not None:
                self.features.setdefault(sr.request_id, []).append(feats)
        for sr, n_acc, err in zip(so.scheduled, res.num_accepted_drafts, res.errors, strict=True):
            if not sr.spec_token_ids or err is not None:
                continue
            req = requests.get(sr.request_id)  # None once released
            bucket = temperature_bucket(req.params.temperature) if req is not None else None
            st.observe(len(sr.spec_token_ids), n_acc, bucket)
            self.backoff.observe(sr.request_id, len(sr.spec_token_ids), n_acc)
            if self.adaptive is not None and bucket is not None:
                self.adaptive.observe_verification(sr.request_id, len(sr.spec_token_ids), n_acc, bucket)
            if req is not None:
                req.spec_num_drafts += 1
                req.spec_num_draft_tokens += len(sr.spec_token_ids)
                req.spec_num_accepted_tokens += n_acc
        return st

    def propose(self, so: SchedulerOutput, running: list[Request], kv: KVCacheManager,
                stats: IterationStats) -> None:
        """After a step's outputs: account its cost and preemptions, then draft for the next step."""
        self._observe_step(so, stats.step_seconds)
        self._preempted(so.preempted_ids)
        self._propose(running, kv, stats)
        if self.proposer.shares_target_blocks:
            self._catch_up(running, kv)
        self._fit_structured_drafts(running)

    def _fit_structured_drafts(self, running: list[Request]) -> None:
        """Constrained requests' drafts cut where the grammar rejects them, or its forced tokens."""
        if not self.structured.matchers:
            return
        k = self.spec.tokens_for_batch(len(running))
        for req in running:
            if req.request_id in self.structured.matchers:
                self.structured.fit_drafts(req, self._room(req, k), keep=req.spec_draft_probs is not None)

    def _propose(self, running: list[Request], kv: KVCacheManager, stats: IterationStats) -> None:
        """Drafts for requests in decode, verified next step: the static controls cap K, and with "auto" the
        adaptive controller picks per request within that."""
        k_batch = self.spec.tokens_for_batch(len(running))
        if self.adaptive is not None:
            stats.spec_cost_estimates = self.adaptive.estimates()
        if k_batch == 0:
            return
        rows = _decoding_requests(running)
        if self.adaptive is not None and self.adaptive.drafting_hopeless(rows):
            # What choose() would say, known before the lookups.
            stats.spec_chosen_k = [0] * sum(1 for req in running if self._room(req, k_batch) > 0)
            return
        reqs, targets = self._draft_requests(running, kv, k_batch)
        if not reqs:
            stats.spec_chosen_k = []
            return
        if self.proposer.shares_target_blocks:
            self._take_in_long_catch_ups(reqs, targets)
        t0 = time.monotonic()
        drafts: list[list[int]] | None = None
        if self.adaptive is not None:
            drafts = self._choose_k(reqs, targets, rows)
        stats.spec_chosen_k = [r.num_drafts for r in reqs]
        if drafts is None:
            keep = [i for i, r in enumerate(reqs) if r.num_drafts > 0]
            for r in reqs:
                if r.num_drafts == 0 and r.features:  # taken in by _catch_up
                    self.features[r.request_id] = r.features
            drafts = [[] for _ in reqs]
            for i, d in zip(keep, self._draft([reqs[i] for i in keep], [targets[i] for i in keep]),
                            strict=True):
                drafts[i] = d
        # Per token made: for lookups every token looked up (spent whatever the choice).
        made = sum(len(d) for d in drafts)
        qs = self.proposer.draft_probs()
        for req, r, d in zip(targets, reqs, drafts, strict=True):
            req.spec_token_ids = list(d[: r.num_drafts])
            q = qs.get(req.request_id)
            if q is not None and req.spec_token_ids:
                req.spec_draft_probs = q[: len(req.spec_token_ids)]
        stats.spec_propose_seconds = seconds = time.monotonic() - t0
        if self.adaptive is not None:
            self.adaptive.observe_draft(made, seconds)

    def _draft_requests(self, running: list[Request], kv: KVCacheManager,
                        k_batch: int) -> tuple[list[DraftRequest], list[Request]]:
        """The requests that may draft this step, each with the most drafts it may take."""
        reqs: list[DraftRequest] = []
        targets: list[Request] = []
        for req in running:
            k = self._room(req, k_batch)
            if k < 1:
                continue
            if self.adaptive is None and not self.proposer.filters_drafts \
                    and not self.backoff.should_draft(req.request_id):
                continue  # "auto" does its own back-off
            # Drafts write the head's KV at positions up to num_tokens + k - 3 of the target's table.
            if self.proposer.shares_target_blocks and not kv.allocate_slots(
                    req.request_id, req.num_computed_tokens, 0, num_lookahead_tokens=k - 1):
                continue
            reqs.append(DraftRequest(req.request_id, req.all_token_ids, req.num_prompt_tokens, k,
                                     kv.block_table(req.request_id), req.cache_salt, req.params,
                                     self.hidden.get(req.request_id), self.features.pop(req.request_id, [])))
            targets.append(req)
        return reqs, targets

    def _take_in_long_catch_ups(self, reqs: list[DraftRequest], targets: list[Request]) -> None:
        """A prompt's worth of catch-up rows (a request's first draft) runs before the timed draft call, so
        the adaptive controller's draft cost holds what drafting adds; the newest row stays with the draft."""
        early: list[DraftRequest] = []
        early_targets: list[Request] = []
        for r, req in zip(reqs, targets, strict=True):
            if sum(int(f.rows.shape[0]) for f in r.features) > LONG_CATCH_UP:
                *older, newest = r.features
                n = int(newest.rows.shape[0])
                if n > 1:
                    older.append(FeatureRows(newest.start, newest.rows[: n - 1]))
                    newest = FeatureRows(newest.start + n - 1, newest.rows[n - 1:])
                early.append(dataclasses.replace(r, num_drafts=0, features=older))
                early_targets.append(req)
                r.features = [newest]
        self._draft(early, early_targets)

    def _catch_up(self, running: list[Request], kv: KVCacheManager) -> None:
        """Features no draft took this step go to the proposer anyway (`shares_target_blocks`)."""
        reqs: list[DraftRequest] = []
        targets: list[Request] = []
        for req in running:
            feats = self.features.pop(req.request_id, None)
            if feats and not req.spec_disabled:
                reqs.append(DraftRequest(req.request_id, req.all_token_ids, req.num_prompt_tokens, 0,
                                         kv.block_table(req.request_id), req.cache_salt, req.params,
                                         features=feats))
                targets.append(req)
        self._draft(reqs, targets)

    def _choose_k(self, reqs: list[DraftRequest], targets: list[Request],
                  rows: int) -> list[list[int]] | None:
        """Set each request's num_drafts to the adaptive K; -> the drafts where the proposer drafts first
        (lookups), else None."""
        assert self.adaptive is not None
        drafts: list[list[int]] | None = None
        if self.proposer.drafts_before_choice:
            # Lookups first: a request without a match is no candidate, and the cost holds only real drafts.
            drafts = self._draft(reqs, targets)
            for r, d in zip(reqs, drafts, strict=True):
                r.num_drafts = len(d)
        has = [i for i, r in enumerate(reqs) if r.num_drafts > 0]
        cands = [Candidate(reqs[i].request_id, reqs[i].num_drafts, self.proposer.catch_up_tokens(reqs[i]),
                           temperature_bucket(targets[i].params.temperature)) for i in has]
        ks = [0] * len(reqs)
        for i, k in zip(has, self.adaptive.choose(cands, rows, rows, num_rows=rows), strict=True):
            ks[i] = k
        for r, k in zip(reqs, ks, strict=True):
            r.num_drafts = k
        return drafts

    def _room(self, req: Request, k_batch: int) -> int:
        """Drafts `req` may take this step (0: off for it, still prefilling, or no room)."""
        if req.spec_disabled or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        return max(0, min(k_batch, req.max_tokens - req.num_output_tokens - 1, self.max_len - req.num_tokens))

    def _draft(self, reqs: list[DraftRequest], targets: list[Request]) -> list[list[int]]:
        """The proposer's drafts; where a batch fails, each request alone, and one that fails alone stops
        drafting."""
        if not reqs:
            return []
        try:
            return self._call_proposer(reqs)
        except Exception:  # noqa: BLE001
            logger.warning("proposer failed on a batch of %d; retrying each request alone", len(reqs))
        drafts: list[list[int]] = []
        for req, r in zip(targets, reqs, strict=True):
            try:
                drafts.append(self._call_proposer([r])[0])
            except Exception:  # noqa: BLE001
                logger.exception("proposer failed for %s; speculation disabled for it", req.request_id)
                req.spec_disabled = True
                self.proposer.release(req.request_id, finished=False)
                drafts.append([])
        return drafts

    def _call_proposer(self, reqs: list[DraftRequest]) -> list[list[int]]:
        self.faults.raise_if("proposer_error", (r.token_ids[: r.num_prompt_tokens] for r in reqs))
        return self.proposer.propose(reqs)

    def release(self, req: Request) -> None:
        """A request ended: drop what every part keeps for it."""
        self.backoff.release(req.request_id)
        self.hidden.pop(req.request_id, None)
        self.features.pop(req.request_id, None)
        if self.adaptive is not None:
            self.adaptive.release(req.request_id)
        normal = req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        self.proposer.release(req.request_id, finished=normal)


def _decoding_requests(running: list[Request]) -> int:
    """Requests the next step decodes: the step whose rate drafting must beat. Prefill chunks are left out:
    they made a mixed step look slow per token, so that catch-up prefills seemed to pay."""
    return sum(1 for req in running if req.num_tokens - req.num_computed_tokens <= 1)
