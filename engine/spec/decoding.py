"""Speculative decoding as one object: the proposer, the static K controls, per-request back-off, the
adaptive K controller and the draft bookkeeping. The engine core calls it at fixed points of a step
(`observe` the verifications, `observe_step` its cost, `release` ended requests, `propose` the next
drafts) and knows nothing else about speculation.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.faults import FaultInjector, InjectedFault
from engine.kv.block_manager import KVCacheManager
from engine.models.loader import LoadedModel
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner
from engine.sampling import temperature_bucket
from engine.scheduler import RunnerOutput, SchedulerOutput
from engine.spec.adaptive import AdaptiveController, Candidate
from engine.spec.backoff import DraftBackoff
from engine.spec.factory import build_proposer
from engine.spec.proposer import DraftRequest, Proposer
from engine.stats import IterationStats, SpecDecodingStats

logger = logging.getLogger(__name__)


class SpecDecoding:
    def __init__(self, spec: Any, draft: LoadedModel | None, draft_blocks: int, block_size: int,
                 target: LoadedModel, runner: ModelRunner, max_len: int) -> None:
        """`spec`: the parsed speculative config; `max_len`: the last position drafts may reach (the
        target's context, capped by the draft's and the config's)."""
        self.spec = spec
        self.max_len = max_len
        self.faults: FaultInjector | None = runner.faults
        self.proposer: Proposer = build_proposer(spec, draft, draft_blocks, block_size, target, runner)
        self.runner = runner
        runner.rejection = spec.rejection
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
                    f", draft {draft.name} ({draft.path}), its KV cache {draft_blocks} blocks"
                    if draft is not None else "")
        rule = spec.rejection
        if rule.method == "synthetic":
            logger.warning("speculative decoding: SYNTHETIC acceptance (benchmarking only): every draft is "
                           "accepted with probability %s whatever it is; outputs are NOT the model's",
                           rule.synthetic_acceptance_rate)
        elif rule.method == "typical":
            logger.warning("speculative decoding: LOSSY typical acceptance (posterior_threshold=%s, "
                           "posterior_alpha=%s): sampled outputs no longer follow the model's distribution",
                           rule.posterior_threshold, rule.posterior_alpha)

    def observe_step(self, so: SchedulerOutput, seconds: float) -> None:
        """The step's cost, for the adaptive controller's rate model."""
        if self.adaptive is None:
            return
        if all(sr.num_logits == len(sr.token_ids) for sr in so.scheduled):
            # Decode/verify steps only: a long prefill chunk is far cheaper per token than draft rows.
            drafting = sum(1 for sr in so.scheduled if len(sr.token_ids) > 1)
            self.adaptive.observe_step(so.num_batched_tokens, seconds, len(so.scheduled), drafting)
        else:
            self.adaptive.skip_step()

    def preempted(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.runner.draft_probs.pop(rid, None)
            self.proposer.release(rid, finished=False)

    def observe(self, so: SchedulerOutput, res: RunnerOutput,
                requests: dict[str, Request]) -> SpecDecodingStats:
        """Count this step's verifications (before the scheduler's update: requests finishing now still
        count their last one)."""
        st = SpecDecodingStats()
        for sr, n_acc, err in zip(so.scheduled, res.num_accepted_drafts, res.errors, strict=True):
            if not sr.spec_token_ids or err is not None:
                continue
            req = requests.get(sr.request_id)  # None only for a request already released: no bucket
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

    def propose(self, running: list[Request], kv: KVCacheManager, stats: IterationStats) -> None:
        """Ask the proposer for drafts of requests in decode; drafts are verified next step.
        K: the static controls give the most a request may take; with "auto" the adaptive controller
        picks per request within that (0 included)."""
        k_batch = self.spec.tokens_for_batch(len(running))
        if self.adaptive is not None:
            stats.spec_cost_estimates = self.adaptive.estimates()
        if k_batch == 0:
            return
        rows = _decoding_requests(running)
        if self.adaptive is not None and self.adaptive.drafting_hopeless(rows):
            # What choose() would say, known before the lookups and before their requests are built.
            stats.spec_chosen_k = [0] * sum(1 for req in running if self._room(req, k_batch) > 0)
            return
        reqs: list[DraftRequest] = []
        targets: list[Request] = []
        for req in running:
            k = self._room(req, k_batch)
            if k < 1:
                continue
            if self.adaptive is None and not self.proposer.filters_drafts \
                    and not self.backoff.should_draft(req.request_id):
                continue  # with "auto" the controller does its own back-off and re-probing
            reqs.append(DraftRequest(req.request_id, req.all_token_ids, req.num_prompt_tokens, k,
                                     kv.block_table(req.request_id), req.cache_salt, req.params))
            targets.append(req)
        if not reqs:
            stats.spec_chosen_k = []
            return
        t0 = time.monotonic()
        drafts: list[list[int]] | None = None
        if self.adaptive is not None:
            if self.proposer.drafts_before_choice:
                # Lookups first: a request without a match is no candidate (it neither drafts nor counts
                # as backed off), and the step's predicted cost holds only drafts that exist.
                drafts = self._draft(reqs, targets)
                for r, d in zip(reqs, drafts, strict=True):
                    r.num_drafts = len(d)
            has = [i for i, r in enumerate(reqs) if r.num_drafts > 0]
            cands = [Candidate(reqs[i].request_id, reqs[i].num_drafts, self.proposer.catch_up_tokens(reqs[i]),
                               temperature_bucket(targets[i].params.temperature)) for i in has]
            ks = [0] * len(reqs)
            for i, k in zip(has, self.adaptive.choose(cands, rows, rows, num_rows=rows), strict=True):
                ks[i] = k
            stats.spec_chosen_k = ks
            for r, k in zip(reqs, ks, strict=True):
                r.num_drafts = k
        else:
            stats.spec_chosen_k = [r.num_drafts for r in reqs]
        if drafts is None:
            keep = [i for i, r in enumerate(reqs) if r.num_drafts > 0]
            drafts = [[] for _ in reqs]
            for i, d in zip(keep, self._draft([reqs[i] for i in keep], [targets[i] for i in keep]),
                            strict=True):
                drafts[i] = d
        # Per token made: for lookups every token looked up, not only the ones chosen (their time is spent
        # whatever the choice, and the few chosen under load would price a free draft like a dear one).
        made = sum(len(d) for d in drafts)
        qs = self.proposer.draft_probs()
        for req, r, d in zip(targets, reqs, drafts, strict=True):
            req.spec_token_ids = list(d[: r.num_drafts])
            q = qs.get(req.request_id)
            if q is not None and req.spec_token_ids:
                self.runner.draft_probs[req.request_id] = q[: len(req.spec_token_ids)]
        stats.spec_propose_seconds = seconds = time.monotonic() - t0
        if self.adaptive is not None:
            self.adaptive.observe_draft(made, seconds)

    def _room(self, req: Request, k_batch: int) -> int:
        """Drafts `req` may take this step (0: speculation off for it, still prefilling, or no room left)."""
        if req.spec_disabled or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        return max(0, min(k_batch, req.max_tokens - req.num_output_tokens - 1, self.max_len - req.num_tokens))

    def _draft(self, reqs: list[DraftRequest], targets: list[Request]) -> list[list[int]]:
        """The proposer's drafts; where a batch fails, each request alone, and one that fails alone
        stops drafting (drafting is an optimisation: the rest go on)."""
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
        faults = self.faults
        if faults is not None:
            prompts = {r.request_id: r.token_ids[: r.num_prompt_tokens] for r in reqs}
            if any(faults.hits("proposer_error", p) for p in prompts.values()):
                raise InjectedFault("injected fault: proposer_error")
        return self.proposer.propose(reqs)

    def release(self, req: Request) -> None:
        """A request ended: drop what every part keeps for it."""
        self.backoff.release(req.request_id)
        self.runner.draft_probs.pop(req.request_id, None)
        if self.adaptive is not None:
            self.adaptive.release(req.request_id)
        normal = req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        self.proposer.release(req.request_id, finished=normal)


def _decoding_requests(running: list[Request]) -> int:
    """Requests the next step decodes (sampled ones included): the step whose rate drafting must
    beat. Prefill chunks in the same step are left out: their time is spent whatever the drafts,
    and counted in the rate they made a mixed step look slow per token, so that a draft model's
    catch-up prefill seemed to pay and a self-draft drafted at every new wave."""
    return sum(1 for req in running if req.num_tokens - req.num_computed_tokens <= 1)
