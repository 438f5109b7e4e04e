"""EngineCore: one synchronous step = schedule -> execute -> update -> postprocess -> propose; engine/loop.py
runs it on its own thread, engine/llm.py directly (docs/architecture.md)."""

from __future__ import annotations

import logging
import time

from engine.attention.selector import attention_for_cache
from engine.config import EngineConfig
from engine.cpu.attention import cpu_paged_attention
from engine.cpu.layers import CpuLayerStack, build_stack
from engine.cpu.qgemm import INT8_AUTO_ISAS
from engine.detokenize import StopMatcher
from engine.faults import FaultHooks
from engine.kv.block_manager import KVCacheManager
from engine.kv.cache import PagedKVCache, head_major_default
from engine.models import adapter
from engine.models.eagle3 import LoadedEagle3
from engine.models.loader import LoadedModel, load_model
from engine.models.weights import int8_products, set_activation_precision
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampler import set_global_seed
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.spec.config import Eagle3Config, MTPConfig
from engine.spec.decoding import SpecDecoding
from engine.spec.factory import Draft, draft_bytes_per_block, load_draft
from engine.stats import IterationStats, SpecDecodingStats
from engine.step import RunnerOutput, SchedulerOutput
from engine.structured import CompiledGrammar, GrammarCompiler, StructuredOutputManager
from engine.tensor_parallel.group import TensorParallel

logger = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 4096
# Steps in a row whose forward raised for every request alone: past this the runner is broken.
MAX_FAILED_STEPS = 2
# What a client is told when the forward raised for its request (the exception goes to the log).
_FORWARD_FAILED = "the forward pass failed"


class EngineFatalError(RuntimeError):
    """The engine cannot go on: the loop fails every request and stops."""


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.tp = _tensor_parallel(config, loaded)
        self.loaded = loaded or load_model(config.model, config.dtype, config.revision,
                                           config.chat_template, progress=config.show_progress,
                                           quantization=config.quantization,
                                           shard=self.tp.shard if self.tp is not None else None)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = self._resolve_max_model_len()
        self.spec = config.speculative_config
        draft = (load_draft(self.spec, self.loaded, config.dtype, config.show_progress,
                            share_target=self.tp is None) if self.spec else None)
        self.spec_max_len = self.max_model_len
        if isinstance(draft, LoadedModel):
            self.spec_max_len = min(self.max_model_len, draft.max_position_embeddings or self.max_model_len)
        if self.spec is not None and self.spec.max_model_len:
            self.spec_max_len = min(self.spec_max_len, self.spec.max_model_len)
        draft_blocks = self._build_kv_cache(draft)
        self.kv = KVCacheManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len)
        self.faults = FaultHooks(config.fault_injection)
        self.runner = self._build_runner(draft.aux_layer_ids if isinstance(draft, LoadedEagle3) else ())
        self.structured = StructuredOutputManager(GrammarCompiler(self.tokenizer, self.loaded.vocab_size,
                                                                  self.loaded.eos_token_ids))
        self.speculation: SpecDecoding | None = None
        if self.spec is not None:
            self.speculation = SpecDecoding(self.spec, draft, draft_blocks, config.block_size, self.loaded,
                                            self.kv_cache, self.runner.caches[0].attention_fn,
                                            self.spec_max_len, self.structured, self.faults)
        self.processor = OutputProcessor(self.scheduler, self.tokenizer, self.structured,
                                         self._release_request, self.max_model_len, self.faults)
        self._failed_steps = 0  # consecutive steps whose forward raised for every request
        set_global_seed(config.seed)

    def _build_kv_cache(self, draft: Draft | None) -> int:
        """The target's paged KV cache out of --kv-cache-memory; returns the draft's share in blocks."""
        bs = self.config.block_size
        layout = adapter.kv_layout(self.loaded.model)
        per_block = PagedKVCache.bytes_per_block(layout.shapes, bs, self.loaded.dtype)
        if isinstance(draft, LoadedEagle3):  # the head's KV sits at the target's block ids: one budget
            per_block += draft_bytes_per_block(draft, bs)
            draft = None
        num_blocks, draft_blocks = self._split_kv_budget(per_block, draft)
        need = -(-self.max_model_len // bs)
        if num_blocks < need:
            raise ValueError(
                f"kv_cache_memory={self.config.kv_cache_memory!r} gives {num_blocks} blocks of {bs} tokens "
                f"({per_block} bytes each) but one request of max_model_len={self.max_model_len} needs "
                f"{need}: raise --kv-cache-memory or lower --max-model-len")
        if self.tp is not None:  # the other ranks size their KV slices to rank 0's block count
            self.tp.broadcast([num_blocks], 1)
        self.kv_cache = PagedKVCache(layout.shapes, num_blocks, bs, self.loaded.dtype,
                                     head_major=head_major_default(self.config.kv_layout))
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s; %s)", num_blocks, bs,
                    num_blocks * bs, self.kv_cache.nbytes / 2**20, self.loaded.dtype,
                    adapter.describe_layout(layout))
        return draft_blocks

    def _build_runner(self, aux_layers: tuple[int, ...]) -> ModelRunner:
        config, model = self.config, self.loaded.model
        attention_fn, attention_label = attention_for_cache(config.attention_backend, self.kv_cache)
        logger.info("attention backend: %s; KV layout: %s", attention_label,
                    "head-major" if self.kv_cache.head_major else "block-major")
        int8 = set_activation_precision(model, config.activation_precision)
        logger.info("activation precision: %s%s",
                    "int8 (4-bit and GGML block products), float32 elsewhere" if int8 else "float32",
                    f" (auto: int8 on {', '.join(sorted(INT8_AUTO_ISAS))} kernels only)"
                    if config.activation_precision == "auto" and not int8 else "")
        stack: CpuLayerStack | None = None
        if self.tp is None:
            stack, why = build_stack(model, self.kv_cache, adapter.kv_layout(model).windows,
                                     attention_fn is cpu_paged_attention, self.loaded.config,
                                     act_int8=int8_products(model))
        else:
            why = f"tensor parallel over {self.tp.size} ranks, all-sums between the layers"
        logger.info("weights: %s; layers: %s", self.loaded.precision,
                    why if stack else f"MLX modules ({why})")
        spec = self.spec
        return ModelRunner(model, self.kv_cache, attention_fn, stack=stack, vocab_size=self.loaded.vocab_size,
                           rejection=spec.rejection if spec is not None else None,
                           keep_hidden=isinstance(spec, MTPConfig), aux_layers=aux_layers, tp=self.tp,
                           faults=self.faults)

    def _split_kv_budget(self, per_block: int, draft: Draft | None) -> tuple[int, int]:
        """(target blocks, draft blocks) out of --kv-cache-memory: a block each with a static K, a quarter
        of the draft's share with "auto" (docs/speculative-decoding.md#methods)."""
        budget = self.config.kv_cache_bytes()
        if draft is None:
            return budget // per_block, 0
        bs = self.config.block_size
        draft_per_block = draft_bytes_per_block(draft, bs)
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
        """`stop_matcher` and `grammar` are built beforehand by a server, off the engine thread (None: built
        here). Raises and leaves no state behind."""
        max_tokens = self.check_request(prompt_token_ids, params)
        self.faults.raise_if("add_request_error", [prompt_token_ids])
        if params.structured is not None and grammar is None:
            grammar = self.structured.compiler.compile(params.structured)
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                      max_tokens=max_tokens, eos_token_ids=self.loaded.eos_token_ids)
        self.scheduler.add_request(req)
        self.processor.add(req, stop_matcher)
        if grammar is not None:
            self.structured.add(request_id, grammar)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.processor.abort(request_id)

    def take_finished_backlog(self) -> IterationStats | None:
        """Stats for requests that ended between steps, if any (the loop reports them when idle)."""
        if not self.processor.finished_backlog:
            return None
        return self._new_stats(time.monotonic(), None, None)

    def _new_stats(self, t0: float | None, so: SchedulerOutput | None,
                   spec: SpecDecodingStats | None) -> IterationStats:
        """The step's stats so far (`t0`: its start; None: between steps), with requests ended meanwhile."""
        now = time.monotonic()
        stats = IterationStats(
            timestamp=now, step_seconds=now - t0 if t0 is not None else 0.0,
            num_scheduled_requests=len(so.scheduled) if so else 0, num_prompt_tokens=0,
            num_generation_tokens=0, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), kv_cache_usage=self.kv.usage(),
            num_preempted=len(so.preempted_ids) if so else 0, prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits)
        stats.num_batched_tokens = so.num_batched_tokens if so else 0
        stats.finished, self.processor.finished_backlog = self.processor.finished_backlog, []
        stats.spec = spec
        return stats

    def close(self) -> None:
        """Tell the other tensor-parallel ranks to stop (on the engine's thread, which runs collectives)."""
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
        # Counted before the update: requests finishing now still count their last verification.
        spec_stats = spec.observe(so, res, self.scheduler.requests) if spec is not None else None
        updates = self.scheduler.update(so, res)
        stats = self._new_stats(t0, so, spec_stats)
        outputs = self.processor.process(updates, so, res, stats)
        stats.num_running = len(self.scheduler.running)
        stats.kv_cache_usage = self.kv.usage()
        if spec is not None:
            spec.propose(so, self.scheduler.running, self.kv, stats)
        return outputs, stats

    def _execute(self, so: SchedulerOutput) -> RunnerOutput:
        """The runner's step; a failure fails only the requests that fail alone, and a runner failing every
        request MAX_FAILED_STEPS steps in a row raises EngineFatalError."""
        try:
            res = self.runner.execute(so)
            self._failed_steps = 0
            return res
        except Exception as e:  # noqa: BLE001 - one bad request must not kill the engine thread
            if self.tp is not None:  # ranks may be at different collectives: no step can follow
                raise EngineFatalError(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e
            if len(so.scheduled) == 1:
                logger.exception("step failed; failing its request %s", so.scheduled[0].request_id)
                res, raised = RunnerOutput.failed(1, _FORWARD_FAILED), 1
            else:
                logger.warning("batched step failed (%s: %s); re-running its %d requests one by one",
                               type(e).__name__, e, len(so.scheduled))
                res, raised = self._execute_isolated(so)
            self._failed_steps = self._failed_steps + 1 if raised == len(so.scheduled) else 0
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise EngineFatalError(f"the forward pass failed for every request of {self._failed_steps} "
                                       f"steps in a row") from e
            return res

    def _execute_isolated(self, so: SchedulerOutput) -> tuple[RunnerOutput, int]:
        """Fault isolation: run each request of a failed batch alone (KV slots are rewritten with the same
        values). -> the output and how many requests raised alone."""
        res = RunnerOutput()
        raised = 0
        for sr in so.scheduled:
            try:
                one = self.runner.execute(SchedulerOutput([sr], len(sr.token_ids)))
            except Exception as e:  # noqa: BLE001
                logger.error("request %s failed on its own: %s: %s", sr.request_id, type(e).__name__, e)
                one = RunnerOutput.failed(1, _FORWARD_FAILED)
                raised += 1
            res.extend(one)
        return res, raised

    def _release_request(self, req: Request) -> None:
        self.structured.release(req.request_id)
        if self.speculation is not None:
            self.speculation.release(req)


def _tensor_parallel(config: EngineConfig, loaded: LoadedModel | None) -> TensorParallel | None:
    """This engine as rank 0 of a tensor-parallel group (the other ranks follow its forwards), if asked."""
    tp_size = config.tensor_parallel_size
    if tp_size <= 1:
        return None
    if loaded is not None:
        raise ValueError("tensor parallelism loads its own slice of the model: pass no LoadedModel")
    if isinstance(config.speculative_config, MTPConfig):
        raise ValueError("--tensor-parallel-size with the mtp method: the assistant reads the target's "
                         "KV cache, of which rank 0 holds only its own heads; use ngram, suffix or "
                         "draft_model")
    if isinstance(config.speculative_config, Eagle3Config):
        raise ValueError("--tensor-parallel-size with the eagle3 method is not supported; use ngram, suffix "
                         "or draft_model")
    return TensorParallel.init(tp_size)
