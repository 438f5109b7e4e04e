"""EngineCore: one step = schedule() -> runner.execute() -> scheduler.update() -> outputs + stats.

Synchronous and single-threaded; `engine/loop.py` runs it on its own thread and `engine/llm.py`
drives it directly for offline use.
"""

from __future__ import annotations

import logging
import time

from engine.attention.cpu import cpu_paged_attention
from engine.attention.selector import attention_for_cache
from engine.config import EngineConfig
from engine.cpu.layers import build_stack
from engine.cpu.qgemm import INT8_AUTO_ISAS
from engine.detokenize import IncrementalDetokenizer, StopMatcher
from engine.distributed import TensorParallel
from engine.faults import FaultInjector, InjectedFault
from engine.kv.block_manager import KVCacheManager
from engine.kv.cache import PagedKVCache, head_major_default
from engine.models import adapter
from engine.models.loader import LoadedModel, load_model
from engine.models.weights import set_activation_precision
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner
from engine.sampler import set_global_seed
from engine.sampling import SamplingParams
from engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from engine.spec.config import MTPConfig
from engine.spec.decoding import SpecDecoding
from engine.spec.factory import load_draft
from engine.stats import FinishedRequestStats, IterationStats
from engine.structured import CompiledGrammar, GrammarCompiler, StructuredOutputManager

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
        # Tensor parallelism: this engine is rank 0 and the other ranks follow its forwards.
        tp_size = config.tensor_parallel_size
        if tp_size > 1 and loaded is not None:
            raise ValueError("tensor parallelism loads its own slice of the model: pass no LoadedModel")
        if tp_size > 1 and isinstance(config.speculative_config, MTPConfig):
            raise ValueError("--tensor-parallel-size with the mtp method: the assistant reads the target's "
                             "KV cache, of which rank 0 holds only its own heads; use ngram, suffix or "
                             "draft_model")
        self.tp = TensorParallel.init(tp_size) if tp_size > 1 else None
        self.loaded = loaded or load_model(config.model, config.dtype, config.revision,
                                           config.chat_template, progress=config.show_progress,
                                           quantization=config.quantization,
                                           shard=self.tp.shard if self.tp is not None else None)
        self.tokenizer = self.loaded.tokenizer
        model = self.loaded.model
        self.max_model_len = self._resolve_max_model_len()
        bs = config.block_size
        layout = adapter.kv_layout(model)
        per_block = PagedKVCache.bytes_per_block(layout.shapes, bs, self.loaded.dtype)
        self.spec = config.speculative_config
        draft = (load_draft(self.spec, self.loaded, config.dtype, config.show_progress,
                            share_target=self.tp is None) if self.spec else None)
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
        if self.tp is not None:  # the other ranks size their KV slices to rank 0's block count
            self.tp.broadcast([num_blocks], 1)
        self.kv_cache = PagedKVCache(layout.shapes, num_blocks, bs, self.loaded.dtype,
                                     head_major=head_major_default(config.kv_layout))
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s; %s)", num_blocks, bs,
                    num_blocks * bs, self.kv_cache.nbytes / 2**20, self.loaded.dtype,
                    adapter.describe_layout(layout))
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len)
        attention_fn, attention_label = attention_for_cache(config.attention_backend, self.kv_cache)
        logger.info("attention backend: %s; KV layout: %s", attention_label,
                    "head-major" if self.kv_cache.head_major else "block-major")
        faults = FaultInjector(config.fault_injection) if config.fault_injection else None
        self.runner = ModelRunner(model, self.kv_cache, attention_fn, faults)
        self.runner.vocab_size = self.loaded.vocab_size
        self.runner.tp = self.tp
        int8 = set_activation_precision(model, config.activation_precision)
        logger.info("activation precision: %s%s",
                    "int8 (4-bit products), float32 elsewhere" if int8 else "float32",
                    f" (auto: int8 on {', '.join(sorted(INT8_AUTO_ISAS))} kernels only)"
                    if config.activation_precision == "auto" and not int8 else "")
        if self.tp is None:
            stack, why = build_stack(model, self.kv_cache, layout.windows,
                                     attention_fn is cpu_paged_attention, self.loaded.config, act_int8=int8)
        else:
            stack, why = None, f"tensor parallel over {self.tp.size} ranks, all-sums between the layers"
        self.runner.stack = stack
        logger.info("weights: %s; layers: %s", self.loaded.precision,
                    why if stack else f"MLX modules ({why})")
        self.speculation: SpecDecoding | None = None
        if self.spec is not None:
            self.speculation = SpecDecoding(self.spec, draft, draft_blocks, bs, self.loaded, self.runner,
                                            self.spec_max_len)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.structured = StructuredOutputManager(GrammarCompiler(self.tokenizer, self.loaded.vocab_size,
                                                                  self.loaded.eos_token_ids))
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
                    stop_matcher: StopMatcher | None = None, grammar: CompiledGrammar | None = None) -> None:
        """`stop_matcher`: `engine.detokenize.stop_matcher(params.stop)`, and `grammar`:
        `self.structured.compiler.compile(params.structured)`, built beforehand by a server so that the
        engine thread never pays for them (None: built here). Raises (a GrammarError, a ValueError, for a
        grammar that does not compile) and leaves no state behind."""
        max_tokens = self.check_request(prompt_token_ids, params)
        faults = self.runner.faults
        if faults is not None and faults.hits("add_request_error", prompt_token_ids):
            raise MemoryError("injected fault: add_request_error")
        if params.structured is not None and grammar is None:
            grammar = self.structured.compiler.compile(params.structured)
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                      max_tokens=max_tokens, eos_token_ids=self.loaded.eos_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params, stop_matcher)
        self.scheduler.add_request(req)
        self._detok[request_id] = detok
        if grammar is not None:
            self.structured.add(request_id, grammar)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return None
        self._detok.pop(request_id, None)
        self._release_request(req)
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

    def close(self) -> None:
        """Release what outlives the process's objects: the other tensor-parallel ranks are told to stop
        (on the engine's thread, which runs every collective)."""
        if self.tp is not None:
            tp, self.tp = self.tp, None
            try:
                tp.send_stop()
            except RuntimeError as e:  # a rank already gone: the group is broken either way
                logger.warning("tensor parallel: could not tell the other ranks to stop: %s", e)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], IterationStats | None]:
        t0 = time.monotonic()
        so = self.scheduler.schedule()
        if so.is_empty:
            return [], None
        self.structured.attach(so)
        res = self._execute(so)
        spec = self.speculation
        spec_stats = spec.observe(so, res, self.scheduler.requests) if spec is not None else None
        updates = self.scheduler.update(so, res)
        for req, new_tokens in updates:
            if not self.structured.accept(req.request_id, new_tokens) and not req.status.finished:
                # Masked rows cannot leave the grammar; a request that did fails rather than go on unchecked.
                req.error = "the output left the request's grammar"
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
        now = time.monotonic()
        stats = self._new_stats(now, now - t0, len(so.scheduled))
        stats.num_preempted = len(so.preempted_ids)
        stats.num_batched_tokens = so.num_batched_tokens
        stats.finished, self._finished_backlog = self._finished_backlog, []
        stats.spec = spec_stats
        if spec is not None:
            spec.observe_step(so, now - t0)
            spec.preempted(so.preempted_ids)
        lp_by_id = {sr.request_id: lp for sr, lp in zip(so.scheduled, res.logprobs, strict=True)}
        outputs = [self._emit(req, new_tokens, lp_by_id.get(req.request_id), stats)
                   for req, new_tokens in updates]
        stats.num_running = len(self.scheduler.running)
        stats.kv_cache_usage = self.kv.usage()
        if spec is not None:
            spec.propose(self.scheduler.running, self.kv, stats)
            self._fit_structured_drafts()
        return outputs, stats

    def _fit_structured_drafts(self) -> None:
        """Drafts of constrained requests: cut where the grammar rejects them, or the grammar's forced
        tokens where it allows only one continuation (within the room a draft has)."""
        if not self.structured.matchers or self.spec is None:
            return
        running = self.scheduler.running
        k = self.spec.tokens_for_batch(len(running))
        for req in running:
            if req.request_id not in self.structured.matchers:
                continue
            decoding = not req.spec_disabled and req.num_computed_tokens == req.num_tokens - 1
            limit = min(k, req.max_tokens - req.num_output_tokens - 1,
                        self.spec_max_len - req.num_tokens) if decoding else 0
            self.structured.fit_drafts(req, limit, keep=req.request_id in self.runner.draft_probs)

    def _execute(self, so: SchedulerOutput) -> RunnerOutput:
        """The runner's step; a failure fails only the requests that fail alone, and a runner that fails
        every request MAX_FAILED_STEPS steps in a row is taken to be broken (EngineFatalError)."""
        try:
            res = self.runner.execute(so)
            self._failed_steps = 0
            return res
        except Exception as e:  # noqa: BLE001 - one bad request must not kill the engine thread
            if self.tp is not None:  # the ranks may now be at different collectives: no step can follow
                raise EngineFatalError(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e
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
            return res

    def _emit(self, req: Request, new_tokens: list[int], logprobs: list | None,
              stats: IterationStats) -> RequestOutput:
        """One request's new tokens after the update: text and stop strings, counters, and its release
        when it ended."""
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
                req.stop_reason = stop_str
                if not req.status.finished:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                else:
                    req.status = RequestStatus.FINISHED_STOPPED
        stats.num_generation_tokens += len(new_tokens)
        if new_tokens and req.num_output_tokens == len(new_tokens):
            # Prefill done: count the whole prompt (cached part included), as vLLM does.
            stats.num_prompt_tokens += req.num_prompt_tokens
            stats.time_to_first_tokens.append(stats.timestamp - req.times.arrival)
        elif new_tokens and req.times.inter_token is not None:
            stats.inter_token_latencies.append(req.times.inter_token)
        if req.status.finished:
            if detok is not None and not isinstance(req.stop_reason, str) and req.error is None:
                # release text held back for a stop string that never came
                text += self._detokenize(req, detok, None)[0]
            self._detok.pop(req.request_id, None)
            self._release_request(req)
            stats.finished.append(self._finished_stats(req))
        return self._output(req, new_tokens, text, logprobs)

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

    def _release_request(self, req: Request) -> None:
        self.structured.release(req.request_id)
        if self.speculation is not None:
            self.speculation.release(req)

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
            temperature=req.params.temperature, spec_num_draft_tokens=req.spec_num_draft_tokens,
            spec_num_accepted_tokens=req.spec_num_accepted_tokens)


# What a client is told when the forward pass raised for its request (the exception goes to the log).
_FORWARD_FAILED = "the forward pass failed"


def _failed(so: SchedulerOutput, errors: list[str]) -> RunnerOutput:
    n = len(so.scheduled)
    return RunnerOutput(sampled_token_ids=[[] for _ in range(n)], logprobs=[None] * n,
                        num_accepted_drafts=[0] * n, errors=errors)
