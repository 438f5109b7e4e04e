"""A rank other than 0: its slice of the model and KV cache, and a loop running each forward rank 0 sends."""

from __future__ import annotations

import logging
import signal
from typing import Any

from engine.attention.selector import attention_for_cache
from engine.config import EngineConfig
from engine.kv.cache import PagedKVCache, head_major_default
from engine.models import adapter
from engine.models.loader import load_model
from engine.runner import ModelRunner
from engine.tensor_parallel.group import TensorParallel

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
    runner = ModelRunner(loaded.model, kv, attention_fn, tp=tp)
    logger.info("tensor parallel rank %d of %d: %s, KV %d blocks (%s), attention %s", tp.rank, tp.size,
                loaded.precision, num_blocks, adapter.describe_layout(layout), label)
    return runner


def follow(runner: ModelRunner) -> None:
    """Run rank 0's forwards until it says stop (returns) or the group breaks (RuntimeError)."""
    tp = runner.tp
    assert tp is not None
    while (chunks := tp.receive()) is not None:
        runner.forward_chunks(chunks)


def run_follower(config_kwargs: dict[str, Any]) -> int:
    """This process as a follower until rank 0 stops (0), the group breaks (1) or it cannot start (2)."""
    # Rank 0 stops the group; a signal here would only break the step it is running.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        follow(build_follower(EngineConfig(**config_kwargs, show_progress=False)))
    except (ValueError, FileNotFoundError) as e:
        logger.error("cannot start: %s", e)
        return 2
    except RuntimeError as e:  # the ring lost a peer: rank 0 is gone
        logger.error("the tensor-parallel group broke: %s", e)
        return 1
    logger.info("rank 0 stopped the group")
    return 0
