"""Tensor parallelism's pieces that run in one process: zero-head padding (exact), the step message, and
the start-up refusals. The ranks themselves run in tests/scale_out/test_tensor_parallel.py (slow)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.models import adapter
from engine.models.loader import load_model
from engine.tensor_parallel.group import TensorParallel, decode_chunks, encode_chunks
from engine.tensor_parallel.padding import pad_heads
from server.settings import ServerSettings


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_zero_head_padding_changes_no_logit(dtype: str) -> None:
    """9 query / 3 KV heads padded to 12 / 4 (what 2 ranks need): the same logits, with the GGUF's
    quantized projections (auto) and with float32 ones."""
    plain = load_model(None, dtype=dtype, progress=False)
    padded = load_model(None, dtype=dtype, progress=False, shard=lambda m: pad_heads(m, 2))
    attn = padded.model.model.layers[0].self_attn
    assert (attn.n_heads, attn.n_kv_heads) == (12, 4)
    assert adapter.kv_layout(padded.model).shapes[0] == (4, 64)
    ids = mx.array([plain.tokenizer.encode("The tide comes in, and the tide goes out, and the gulls")])
    a = np.array(plain.model(ids)[0])
    b = np.array(padded.model(ids)[0])
    assert np.abs(a - b).max() < 1e-4 * np.abs(a).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_padding_leaves_divisible_heads_alone() -> None:
    loaded = load_model(None, progress=False, shard=lambda m: pad_heads(m, 3))
    assert loaded.model.model.layers[0].self_attn.n_kv_heads == 3


def test_step_message_round_trip() -> None:
    chunks = [([5, 6, 7], 0, [3, 9], 1), ([42], 17, [1, 2, 8], 1), ([], 4, [], 0), ([1, 2], 30, [0], 2)]
    assert decode_chunks(encode_chunks(chunks)) == chunks


def test_a_family_without_sharding_is_refused() -> None:
    class NoShard(nn.Module):
        pass

    tp = TensorParallel(mx.distributed.init())
    with pytest.raises(ValueError, match="no tensor-parallel sharding"):
        tp.shard(NoShard())


def test_tensor_parallel_outside_the_launcher_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLX_RANK", raising=False)
    with pytest.raises(ValueError, match="not started by MLX's launcher"):
        TensorParallel.init(2)


@pytest.mark.parametrize(("flags", "message"), [
    ({"hostfile": "hosts.json"}, "--hostfile needs --tensor-parallel-size"),
    ({"tensor_parallel_size": 2, "replicas": 2}, "not supported"),
])
def test_settings_refuse_what_cannot_run(flags: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerSettings(**flags)


def test_mtp_over_ranks_is_refused_before_anything_loads() -> None:
    from engine.config import EngineConfig
    from engine.core import EngineCore

    config = EngineConfig(tensor_parallel_size=2, speculative_config={"method": "mtp", "model": "x"})
    with pytest.raises(ValueError, match="mtp method"):
        EngineCore(config)
