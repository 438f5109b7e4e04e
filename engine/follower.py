"""A tensor-parallel rank other than 0: its slice of the model and of the paged KV cache, and a loop
that runs each forward rank 0 broadcasts (engine/distributed.py). No scheduler, tokenizer use or HTTP:
rank 0 decides everything and these ranks only add their share to each all-sum."""

from __future__ import annotations

import logging

from engine.attention.selector import attention_for_cache
from engine.config import EngineConfig
from engine.distributed import TensorParallel
from engine.kv.cache import PagedKVCache, head_major_default
from engine.models import adapter
from engine.models.loader import load_model
from engine.runner import ModelRunner

logger = logging.getLogger(__name__)


def build_follower(config: EngineConfig) -> ModelRunner:
    """This rank's runner, built in the same order as rank 0's engine (the same collectives)."""
    tp = TensorParallel.init(config.tensor_parallel_size)
    if tp.leader:
        raise ValueError("rank 0 runs the engine, not a follower")
    loaded = load_model(config.model, config.dtype, config.revision, config.chat_template,
                        progress=False, quantization=config.quantization, shard=tp.shard)
    layout = adapter.kv_layout(loaded.model)
    (num_blocks,) = tp.broadcast(None, 1)
    kv = PagedKVCache(layout.shapes, num_blocks, config.block_size, loaded.dtype,
                      head_major=head_major_default(config.kv_layout))
    attention_fn, label = attention_for_cache(config.attention_backend, kv)
    runner = ModelRunner(loaded.model, kv, attention_fn)
    runner.tp = tp
    logger.info("tensor parallel rank %d of %d: %s, KV %d blocks (%s), attention %s", tp.rank, tp.size,
                loaded.precision, num_blocks, adapter.describe_layout(layout), label)
    return runner


def follow(runner: ModelRunner) -> None:
    """Run rank 0's forwards until it says stop (returns) or the group breaks (RuntimeError)."""
    tp = runner.tp
    assert tp is not None
    while (chunks := tp.receive()) is not None:
        runner.forward_chunks(chunks)
