"""EngineCore: one step = schedule() -> runner.execute() -> scheduler.update() -> outputs + stats.

Synchronous and single-threaded; `engine/loop.py` runs it on its own thread and `engine/llm.py`
drives it directly for offline use.
"""

from __future__ import annotations

import logging
import time

from engine.attention.cpu import cpu_paged_attention
from engine.attention.reference import paged_attention_reference
from engine.attention.selector import cpu_attention_fits, select_attention
from engine.config import EngineConfig
from engine.detokenize import IncrementalDetokenizer, StopMatcher
from engine.faults import FaultInjector, InjectedFault
from engine.kv.block_manager import KVCacheManager
from engine.kv.cache import PagedKVCache, head_major_default
from engine.models import adapter
from engine.models.loader import LoadedModel, load_model
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner
from engine.sampler import set_global_seed
from engine.sampling import SamplingParams
from engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from engine.spec.adaptive import AdaptiveController, Candidate
from engine.spec.backoff import DraftBackoff
from engine.spec.factory import build_proposer, load_draft
from engine.spec.proposer import DraftRequest, Proposer
from engine.stats import FinishedRequestStats, IterationStats, SpecDecodingStats

logger = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 4096
# Steps in a row whose forward pass raised for every request (each alone too): past this the runner
# itself is taken to be broken (a device error, not one request's input) and the engine stops.
MAX_FAILED_STEPS = 2


class EngineFatalError(RuntimeError):
    """The engine cannot go on: the loop fails every request and stops."""


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.revision,
                                           config.chat_template, progress=config.show_progress)
        self.tokenizer = self.loaded.tokenizer
        model = self.loaded.model
        self.max_model_len = self._resolve_max_model_len()
        bs = config.block_size
        n_kv, head_dim = adapter.kv_shape(model)
        per_block = PagedKVCache.bytes_per_block(len(model.layers), bs, n_kv, head_dim, self.loaded.dtype)
        self.spec = config.speculative_config
        draft = load_draft(self.spec, self.loaded, config.dtype, config.show_progress) if self.spec else None
        self.spec_max_len = self.max_model_len
        if draft is not None:
            self.spec_max_len = min(self.max_model_len, draft.max_position_embeddings or self.max_model_len)
        if self.spec is not None and self.spec.max_model_len:
            self.spec_max_len = min(self.spec_max_len, self.spec.max_model_len)
        num_blocks, draft_blocks = self._split_kv_budget(per_block, draft)
        need = -(-self.max_model_len // bs)
        if num_blocks < need:
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory!r} gives {num_blocks} blocks of {bs} tokens "
                f"({per_block} bytes each) but one request of max_model_len={self.max_model_len} needs "
                f"{need}: raise --kv-cache-memory or lower --max-model-len")
        self.kv_cache = PagedKVCache(len(model.layers), num_blocks, bs, n_kv, head_dim, self.loaded.dtype,
                                     head_major=head_major_default(config.kv_layout))
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %d layers, %d kv heads, "
                    "head_dim %d)", num_blocks, bs, num_blocks * bs, self.kv_cache.nbytes / 2**20,
                    self.loaded.dtype, len(model.layers), n_kv, head_dim)
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len)
        attention_fn, attention_label = select_attention(config.attention_backend)
        if attention_fn is cpu_paged_attention and (why := cpu_attention_fits(self.kv_cache)) is not None:
            if config.attention_backend == "cpu":
                raise ValueError(f"--attention-backend cpu: {why}; use auto or reference")
            attention_fn, attention_label = paged_attention_reference, f"reference (MLX ops; C kernel: {why})"
        if attention_fn not in (paged_attention_reference, cpu_paged_attention) and self.kv_cache.head_major:
            raise ValueError("kv_layout=head: the Metal kernels read the block-major KV layout; "
                             "use kv_layout auto/block or --attention-backend reference")
        logger.info("attention backend: %s; KV layout: %s", attention_label,
                    "head-major" if self.kv_cache.head_major else "block-major")
        faults = FaultInjector(config.fault_injection) if config.fault_injection else None
        self.runner = ModelRunner(model, self.kv_cache, attention_fn, faults)
        self.runner.vocab_size = self.loaded.vocab_size
        self.proposer: Proposer | None = None
        self.backoff = DraftBackoff()
        self.adaptive: AdaptiveController | None = None
        if self.spec is not None:
            self.proposer = build_proposer(self.spec, draft, draft_blocks, bs, self.loaded, self.runner)
            if self.spec.adaptive is not None:
                a = self.spec.adaptive
                self.adaptive = AdaptiveController(
                    self.spec.num_speculative_tokens, ema=a.acceptance_ema, base_probe=a.probe_interval,
                    gate_probes=not self.proposer.drafts_before_choice)
            logger.info("speculative decoding: %s, num_speculative_tokens=%s%s", self.spec.method,
                        f"auto (up to {self.spec.num_speculative_tokens})" if self.spec.adaptive
                        else self.spec.num_speculative_tokens,
                        f", draft {draft.name} ({draft.path}), its KV cache {draft_blocks} blocks"
                        if draft is not None else "")
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # Requests that ended outside a step (aborts): reported with the next stats object.
        self._finished_backlog: list[FinishedRequestStats] = []
        self._failed_steps = 0  # consecutive steps whose forward raised for every request
        set_global_seed(config.seed)

    def _split_kv_budget(self, per_block: int, draft: LoadedModel | None) -> tuple[int, int]:
        """(target blocks, draft blocks) out of --kv-cache-memory. A static K drafts for every running
        request, so a draft block stands beside each target block. With "auto" few requests draft under
        load and the draft takes blocks back from requests it is not drafting for (they prefill their
        context into the draft again if chosen later), so it gets a quarter of that share: a self-draft
        otherwise halves the target's pool, and with it the prefix cache, for drafts auto rarely makes."""
        budget = self.config.kv_cache_bytes()
        if draft is None:
            return budget // per_block, 0
        from engine.spec.draft_model import DraftModelProposer

        bs = self.config.block_size
        draft_per_block = DraftModelProposer.bytes_per_block(draft, bs)
        fraction = getattr(self.spec, "draft_kv_cache_fraction", None)
        share = fraction
        if share is None:
            share = draft_per_block / (per_block + draft_per_block)
            if self.spec.adaptive is not None:
                share /= 4
        draft_blocks = int(budget * share) // draft_per_block
        draft_need = -(-self.spec_max_len // bs)  # one request drafting up to its last position
        if draft_blocks < draft_need:
            if fraction is not None:
                raise ValueError(
                    f"invalid --speculative-config: draft_kv_cache_fraction={fraction} gives the draft "
                    f"{draft_blocks} KV blocks but one request of {self.spec_max_len} tokens needs "
                    f"{draft_need}: raise it or --kv-cache-memory")
            draft_blocks = draft_need
        return (budget - draft_blocks * draft_per_block) // per_block, draft_blocks

    def _resolve_max_model_len(self) -> int:
        model_max = self.loaded.max_position_embeddings
        want = self.config.max_model_len
        if want is None:
            return min(model_max or _DEFAULT_MAX_MODEL_LEN, 32768)
        if model_max is not None and want > model_max:
            raise ValueError(f"max_model_len={want} is larger than the model's maximum context "
                             f"({model_max} positions)")
        return want

    # -- requests ------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Validate without touching engine state (thread-safe). Returns the resolved max_tokens."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.loaded.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of vocabulary (size {vocab})")
        params.validate(vocab)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, which leaves no room for output within "
                             f"max_model_len={self.max_model_len}")
        room = self.max_model_len - n
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    stop_matcher: StopMatcher | None = None) -> None:
        """`stop_matcher`: `engine.detokenize.stop_matcher(params.stop)`, built beforehand by a server so
        that the engine thread never pays for it (None: built here). Raises and leaves no state behind."""
        max_tokens = self.check_request(prompt_token_ids, params)
        faults = self.runner.faults
        if faults is not None and faults.hits("add_request_error", prompt_token_ids):
            raise MemoryError("injected fault: add_request_error")
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                      max_tokens=max_tokens, eos_token_ids=self.loaded.eos_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params, stop_matcher)
        self.scheduler.add_request(req)
        self._detok[request_id] = detok

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return None
        self._detok.pop(request_id, None)
        self._release(req)
        self._finished_backlog.append(self._finished_stats(req))
        return self._output(req, [], "", None)

    def take_finished_backlog(self) -> IterationStats | None:
        """Stats for requests that ended between steps, if any (the loop reports them when idle)."""
        if not self._finished_backlog:
            return None
        stats = self._new_stats(time.monotonic(), 0.0, 0)
        stats.finished, self._finished_backlog = self._finished_backlog, []
        return stats

    def _new_stats(self, now: float, step_seconds: float, num_scheduled: int) -> IterationStats:
        return IterationStats(
            timestamp=now, step_seconds=step_seconds, num_scheduled_requests=num_scheduled,
            num_prompt_tokens=0, num_generation_tokens=0, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), kv_cache_usage=self.kv.usage(), num_preempted=0,
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], IterationStats | None]:
        t0 = time.monotonic()
        so = self.scheduler.schedule()
        if so.is_empty:
            return [], None
        try:
            res = self.runner.execute(so)
            self._failed_steps = 0
        except Exception as e:  # noqa: BLE001 - one bad request must not kill the engine thread
            if len(so.scheduled) == 1:
                logger.exception("step failed; failing its request %s", so.scheduled[0].request_id)
                res, raised = _failed(so, [_FORWARD_FAILED]), 1
            else:
                logger.warning("batched step failed (%s: %s); re-running its %d requests one by one",
                               type(e).__name__, e, len(so.scheduled))
                res, raised = self._execute_isolated(so)
            self._failed_steps = self._failed_steps + 1 if raised == len(so.scheduled) else 0
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise EngineFatalError(f"the forward pass failed for every request of {self._failed_steps} "
                                       f"steps in a row") from e
        # Before update(): requests finishing this step still count their last verification.
        spec_stats = self._spec_stats(so, res) if self.spec is not None else None
        updates = self.scheduler.update(so, res)
        lp_by_id = {sr.request_id: lp for sr, lp in zip(so.scheduled, res.logprobs, strict=True)}

        now = time.monotonic()
        if self.adaptive is not None and all(sr.num_logits == len(sr.token_ids) for sr in so.scheduled):
            # Decode/verify steps only: a long prefill chunk is far cheaper per token than draft rows.
            drafting = sum(1 for sr in so.scheduled if len(sr.token_ids) > 1)
            self.adaptive.observe_step(so.num_batched_tokens, now - t0, len(so.scheduled), drafting)
        elif self.adaptive is not None:
            self.adaptive.skip_step()
        stats = self._new_stats(now, now - t0, len(so.scheduled))
        stats.num_preempted = len(so.preempted_ids)
        stats.num_batched_tokens = so.num_batched_tokens
        stats.finished, self._finished_backlog = self._finished_backlog, []
        if self.spec is not None:
            stats.spec = spec_stats
            for rid in so.preempted_ids:
                if self.proposer is not None:
                    self.proposer.release(rid, finished=False)
        outputs: list[RequestOutput] = []
        for req, new_tokens in updates:
            detok = self._detok.get(req.request_id)
            text = ""
            if detok is not None and new_tokens:
                seen = len(detok.output_token_ids)
                text, stop_str = self._detokenize(req, detok, new_tokens)
                if stop_str is not None:
                    # Plain decoding ends at the token that completed the stop string: accepted drafts
                    # after it are dropped, so that usage and metrics count what plain decoding does.
                    kept = len(detok.output_token_ids) - seen
                    req.drop_last_output(len(new_tokens) - kept)
                    new_tokens = new_tokens[:kept]
                if stop_str is not None and not req.status.finished:
                    req.stop_reason = stop_str
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                elif stop_str is not None:
                    req.stop_reason = stop_str
                    req.status = RequestStatus.FINISHED_STOPPED
            stats.num_generation_tokens += len(new_tokens)
            if new_tokens and req.num_output_tokens == len(new_tokens):
                # Prefill done: count the whole prompt (cached part included), as vLLM does.
                stats.num_prompt_tokens += req.num_prompt_tokens
                stats.time_to_first_tokens.append(now - req.times.arrival)
            elif new_tokens and req.times.inter_token is not None:
                stats.inter_token_latencies.append(req.times.inter_token)
            if req.status.finished:
                if detok is not None and not isinstance(req.stop_reason, str) and req.error is None:
                    # release text held back for a stop string that never came
                    text += self._detokenize(req, detok, None)[0]
                self._detok.pop(req.request_id, None)
                self._release(req)
                stats.finished.append(self._finished_stats(req))
            outputs.append(self._output(req, new_tokens, text, lp_by_id.get(req.request_id)))
        stats.num_running = len(self.scheduler.running)
        stats.kv_cache_usage = self.kv.usage()
        if self.proposer is not None:
            self._propose(stats)
        return outputs, stats

    def _detokenize(self, req: Request, detok: IncrementalDetokenizer,
                    new_tokens: list[int] | None) -> tuple[str, str | None]:
        """(text, stop string) for new tokens (None: flush what is held back); a detokenizer or stop
        matcher failure fails this request only."""
        try:
            faults = self.runner.faults
            if faults is not None and faults.hits("detokenize_error", req.prompt_token_ids):
                raise InjectedFault("injected fault: detokenize_error")
            return detok.add(new_tokens) if new_tokens is not None else (detok.flush(), None)
        except Exception:  # noqa: BLE001 - the engine thread must go on for everyone else
            logger.exception("detokenizing %s failed; failing the request", req.request_id)
            req.error = "detokenization failed"  # the exception stays in the log, out of the response
            if req.status.finished:  # it ended this step: only its final status changes
                req.status = RequestStatus.FINISHED_ERROR
            else:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
            return "", None

    def _execute_isolated(self, so: SchedulerOutput) -> tuple[RunnerOutput, int]:
        """Fault isolation: run each request of a failed batch alone, so only the requests that fail
        by themselves are failed. Their KV slots are simply rewritten with the same values.
        Returns the output and how many requests raised alone."""
        res = RunnerOutput()
        raised = 0
        for sr in so.scheduled:
            try:
                one = self.runner.execute(SchedulerOutput([sr], len(sr.token_ids)))
            except Exception as e:  # noqa: BLE001
                logger.error("request %s failed on its own: %s: %s", sr.request_id, type(e).__name__, e)
                one = _failed(SchedulerOutput([sr]), [_FORWARD_FAILED])
                raised += 1
            res.sampled_token_ids += one.sampled_token_ids
            res.logprobs += one.logprobs
            res.num_accepted_drafts += one.num_accepted_drafts
            res.errors += one.errors
        return res, raised

    # -- speculative decoding ------------------------------------------------------------------
    def _spec_stats(self, so: SchedulerOutput, res: RunnerOutput) -> SpecDecodingStats:
        st = SpecDecodingStats()
        for sr, n_acc, err in zip(so.scheduled, res.num_accepted_drafts, res.errors, strict=True):
            if not sr.spec_token_ids or err is not None:
                continue
            st.observe(len(sr.spec_token_ids), n_acc)
            self.backoff.observe(sr.request_id, len(sr.spec_token_ids), n_acc)
            if self.adaptive is not None:
                self.adaptive.observe_verification(sr.request_id, len(sr.spec_token_ids), n_acc)
            req = self.scheduler.requests.get(sr.request_id)
            if req is not None:
                req.spec_num_drafts += 1
                req.spec_num_draft_tokens += len(sr.spec_token_ids)
                req.spec_num_accepted_tokens += n_acc
        return st

    def _propose(self, stats: IterationStats) -> None:
        """Ask the proposer for drafts of greedy requests in decode; drafts are verified next step.
        K: the static controls give the most a request may take; with "auto" the adaptive controller
        picks per request within that (0 included)."""
        assert self.spec is not None and self.proposer is not None
        k_batch = self.spec.tokens_for_batch(len(self.scheduler.running))
        if self.adaptive is not None:
            stats.spec_cost_estimates = self.adaptive.estimates()
        if k_batch == 0:
            return
        reqs: list[DraftRequest] = []
        targets: list[Request] = []
        for req in self.scheduler.running:
            if req.spec_disabled or not req.params.spec_decode_ok:
                continue
            if req.num_computed_tokens != req.num_tokens - 1:
                continue  # still prefilling
            if self.adaptive is None and not self.proposer.filters_drafts \
                    and not self.backoff.should_draft(req.request_id):
                continue  # with "auto" the controller does its own back-off and re-probing
            k = min(k_batch, req.max_tokens - req.num_output_tokens - 1,
                    self.spec_max_len - req.num_tokens)
            if k < 1:
                continue
            reqs.append(DraftRequest(req.request_id, req.all_token_ids, req.num_prompt_tokens, k,
                                     self.kv.block_table(req.request_id), req.cache_salt))
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
            cands = [Candidate(reqs[i].request_id, reqs[i].num_drafts,
                               self.proposer.catch_up_tokens(reqs[i])) for i in has]
            rows = self._decoding_requests()
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
        for req, r, d in zip(targets, reqs, drafts, strict=True):
            req.spec_token_ids = list(d[: r.num_drafts])
        stats.spec_propose_seconds = seconds = time.monotonic() - t0
        if self.adaptive is not None:
            self.adaptive.observe_draft(made, seconds)

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
                self.proposer.release(req.request_id, finished=False)  # type: ignore[union-attr]
                drafts.append([])
        return drafts

    def _decoding_requests(self) -> int:
        """Requests the next step decodes (sampled ones included): the step whose rate drafting must
        beat. Prefill chunks in the same step are left out: their time is spent whatever the drafts,
        and counted in the rate they made a mixed step look slow (1 token in 2 s), so that a draft
        model's catch-up prefill seemed to pay and a self-draft drafted at every new wave."""
        return sum(1 for req in self.scheduler.running if req.num_tokens - req.num_computed_tokens <= 1)

    def _call_proposer(self, reqs: list[DraftRequest]) -> list[list[int]]:
        assert self.proposer is not None
        faults = self.runner.faults
        if faults is not None:
            prompts = {r.request_id: r.token_ids[: r.num_prompt_tokens] for r in reqs}
            if any(faults.hits("proposer_error", p) for p in prompts.values()):
                raise InjectedFault("injected fault: proposer_error")
        return self.proposer.propose(reqs)

    def _release(self, req: Request) -> None:
        self.backoff.release(req.request_id)
        if self.adaptive is not None:
            self.adaptive.release(req.request_id)
        if self.proposer is not None:
            normal = req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            self.proposer.release(req.request_id, finished=normal)

    def _output(self, req: Request, new_tokens: list[int], text: str, logprobs: list | None) -> RequestOutput:
        finished = req.status.finished
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_tokens, new_text=text,
            new_logprobs=logprobs if new_tokens else None, finished=finished,
            finish_reason=req.status.value if finished else None, stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_prompt_tokens, error=req.error,
            spec_num_drafts=req.spec_num_drafts, spec_num_draft_tokens=req.spec_num_draft_tokens,
            spec_num_accepted_tokens=req.spec_num_accepted_tokens)

    @staticmethod
    def _finished_stats(req: Request) -> FinishedRequestStats:
        t = req.times
        end = t.finished or time.monotonic()
        tpot = None
        if t.first_token is not None and t.last_token is not None and req.num_output_tokens > 1:
            tpot = (t.last_token - t.first_token) / (req.num_output_tokens - 1)
        return FinishedRequestStats(
            finish_reason=req.status.value, num_prompt_tokens=req.num_prompt_tokens,
            num_generation_tokens=req.num_output_tokens, e2e_latency=end - t.arrival,
            queue_time=(t.scheduled or end) - t.arrival,
            time_to_first_token=None if t.first_token is None else t.first_token - t.arrival,
            time_per_output_token=tpot, num_cached_tokens=req.num_cached_prompt_tokens,
            spec_num_draft_tokens=req.spec_num_draft_tokens,
            spec_num_accepted_tokens=req.spec_num_accepted_tokens)


# What a client is told when the forward pass raised for its request (the exception goes to the log).
_FORWARD_FAILED = "the forward pass failed"


def _failed(so: SchedulerOutput, errors: list[str]) -> RunnerOutput:
    n = len(so.scheduled)
    return RunnerOutput(sampled_token_ids=[[] for _ in range(n)], logprobs=[None] * n,
                        num_accepted_drafts=[0] * n, errors=errors)
