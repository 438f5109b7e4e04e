"""EAGLE-3's aux hidden states (the residual stream entering chosen decoder layers) from both forward paths:
the C layer stack (engine/cpu/layers.c) and the MLX modules (adapter.hidden_states) agree on the default
model for a flat batch and a single-request chunk, asking for them changes no bit of the hidden states,
id 0 is the embeddings, id L the final norm's input, and the rows equal transformers'
`output_hidden_states` on a tiny llama."""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.attention.types import build_metadata
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cpu import qgemm
from engine.cpu.layers import CpuLayerStack
from engine.models import adapter
from engine.models.loader import LoadedModel, load_model
from engine.models.weights import CpuEmbedding
from engine.runner import ModelRunner
from tests.helpers import CHATS, default_model, save_with_default_tokenizer

WHY = qgemm.unsupported_reason()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"low-precision CPU kernel cannot run here: {WHY}")
AUX = (2, 15, 27)  # EAGLE-3's default [2, L // 2, L - 3] for SmolLM2-135M's 30 layers
Chunks = list[tuple[list[int], int, list[int]]]


def _core(loaded: LoadedModel) -> EngineCore:
    # Float activations: the arithmetic MLX's modules do.
    return EngineCore(EngineConfig(kv_cache_memory="128MiB", max_model_len=1024, show_progress=False,
                                   activation_precision="float32"), loaded)


@functools.cache
def _default_core() -> EngineCore:
    return _core(default_model())


def _run(runner: ModelRunner, chunks: Chunks,
         aux: tuple[int, ...] | None) -> tuple[np.ndarray, np.ndarray | None]:
    """One step over `chunks` (tokens, start, block table) through the runner's stack if it has one, else
    its MLX modules: hidden states [T, hidden] of every row and, with `aux`, the aux rows."""
    meta = build_metadata([(s, len(t), b) for t, s, b in chunks], runner.kv.block_size)
    ids = mx.array([tok for t, _, _ in chunks for tok in t], dtype=mx.int32)
    for c in runner.caches:
        c.meta = meta
    try:
        stack = runner.stack
        if aux is None:
            if stack is not None:
                return np.array(stack.hidden_states(ids, meta)), None
            return np.array(adapter.hidden_states(runner.model, ids, runner.caches)), None
        if stack is not None:
            h, a = stack.hidden_states(ids, meta, aux_layers=aux)
        else:
            h, a = adapter.hidden_states(runner.model, ids, runner.caches, aux_layers=aux)
        return np.array(h), np.array(a)
    finally:
        for c in runner.caches:
            c.meta = None


def _mlx_runner(core: EngineCore) -> ModelRunner:
    """The same model and cache through MLX's modules."""
    r = core.runner
    return ModelRunner(r.model, r.kv, r.caches[0].attention_fn)


def _steps(loaded: LoadedModel) -> list[Chunks]:
    """A 2-request flat batch (one request's first half), then that request's second half alone."""
    a, b = (loaded.tokenizer.encode(t) for t in (CHATS[3], CHATS[1]))
    split = len(a) // 2
    return [[(a[:split], 0, list(range(0, 8))), (b, 0, list(range(8, 16)))],
            [(a[split:], split, list(range(0, 8)))]]


def _embeddings(model: Any, ids: list[int]) -> np.ndarray:
    embed = model.model.embed_tokens
    if isinstance(embed, CpuEmbedding):
        return np.asarray(embed.rows(np.asarray(ids, dtype=np.int32)))
    return np.array(embed(mx.array(ids, dtype=mx.int32)).astype(mx.float32))


def _check_path(runner: ModelRunner, steps: list[Chunks], aux: tuple[int, ...]) -> list[np.ndarray]:
    """Each step's aux rows, checking that asking for them leaves every bit of `h` as it was."""
    out = []
    for chunks in steps:
        plain, _ = _run(runner, chunks, None)
        h, rows = _run(runner, chunks, aux)  # the same KV slots rewritten with the same values
        assert rows is not None and rows.shape == (h.shape[0], len(aux) * h.shape[1])
        assert np.array_equal(h, plain)
        out.append(rows)
    return out


@needs_kernel
def test_c_stack_aux_equals_mlx_modules_and_changes_no_bit() -> None:
    core = _default_core()
    assert isinstance(core.runner.stack, CpuLayerStack), "the C layers should run for the default model here"
    steps = _steps(default_model())
    c_aux = _check_path(core.runner, steps, AUX)
    mlx_aux = _check_path(_mlx_runner(core), steps, AUX)
    d = core.runner.model.args.hidden_size
    for c_rows, m_rows in zip(c_aux, mlx_aux, strict=True):
        assert c_rows.dtype == np.float32
        for j in range(len(AUX)):
            c, m = c_rows[:, j * d : (j + 1) * d], m_rows[:, j * d : (j + 1) * d]
            # Per row: SmolLM2's residual stream has a few huge dimensions, so each row against its own scale.
            err = np.abs(c - m).max(axis=-1) / np.abs(m).max(axis=-1)
            assert err.max() <= 1e-4, (AUX[j], float(err.max()))


@needs_kernel
def test_the_embeddings_the_final_norm_input_and_any_order() -> None:
    """Id 0 is the embeddings and id L the final norm's input, on both paths; ids come back ascending."""
    core = _default_core()
    model = core.runner.model
    n, d = len(model.model.layers), model.args.hidden_size
    for runner in (core.runner, _mlx_runner(core)):
        for chunks in _steps(default_model()):
            h, rows = _run(runner, chunks, (n, 0, 15))
            assert rows is not None
            assert np.array_equal(rows[:, :d], _embeddings(model, [t for ts, _, _ in chunks for t in ts]))
            normed = np.array(model.model.norm(mx.array(rows[:, 2 * d :])))
            assert np.abs(normed - h).max() <= 1e-5 * np.abs(h).max()
            _, again = _run(runner, chunks, (0, 15, n))
            assert again is not None and np.array_equal(rows, again)
        for bad in ((1, 1), (-1,), (n + 1,)):
            with pytest.raises(ValueError, match="aux layer ids"):
                _run(runner, _steps(default_model())[1], bad)


class _Boom:
    """A cache that fails the layer reading it."""

    @property
    def offset(self) -> int:
        raise RuntimeError("boom")


def test_no_tap_is_left_behind() -> None:
    """The MLX path's taps are undone, also when the forward raises."""
    core = _default_core()
    runner = _mlx_runner(core)
    layers = list(runner.model.model.layers)
    classes = [type(m) for m in layers]
    chunks = _steps(default_model())[1]
    _run(runner, chunks, AUX)
    meta = build_metadata([(s, len(t), b) for t, s, b in chunks], runner.kv.block_size)
    for c in runner.caches:
        c.meta = meta
    try:
        caches: list[Any] = [*runner.caches[:-1], _Boom()]  # layer 29 fails, after layer 27's tap
        with pytest.raises(RuntimeError, match="boom"):
            adapter.hidden_states(runner.model, mx.array(chunks[0][0]), caches, aux_layers=AUX)
    finally:
        for c in runner.caches:
            c.meta = None
    assert [type(m) for m in layers] == classes
    assert not any(adapter._TAP_ATTR in m.__dict__ for m in layers)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    """A random-weight 4-layer llama built with transformers, saved with SmolLM2's tokenizer, and loaded."""
    torch = pytest.importorskip("torch", reason="torch (a test-only dependency: pip install torch==2.13.0) "
                                                "is needed to build the transformers reference model")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("llama")
    save_with_default_tokenizer(model, folder)
    return model, load_model(str(folder), dtype="float32", progress=False)


def test_aux_rows_equal_transformers_hidden_states(tiny_llama: tuple[Any, LoadedModel]) -> None:
    """HF's `hidden_states[i]`; its last entry is after the final norm (EAGLE-3's id L: before)."""
    import torch

    hf, loaded = tiny_llama
    core = _core(loaded)
    steps = _steps(loaded)
    ids = (0, 1, 2, 3, 4)
    runners = [_mlx_runner(core)] + ([core.runner] if core.runner.stack is not None else [])
    a_first, b = steps[0][0][0], steps[0][1][0]
    a = a_first + steps[1][0][0]
    with torch.no_grad():
        ref_a = hf(torch.tensor([a]), output_hidden_states=True).hidden_states
        ref_b = hf(torch.tensor([b]), output_hidden_states=True).hidden_states
    d = loaded.model.args.hidden_size
    for runner in runners:
        first, second = (_check_path(runner, [chunks], ids)[0] for chunks in steps)
        rows_a, rows_b = np.concatenate([first[: len(a_first)], second]), first[len(a_first) :]
        for rows, ref in ((rows_a, ref_a), (rows_b, ref_b)):
            for j, i in enumerate(ids):
                want, got = ref[i][0].numpy(), rows[:, j * d : (j + 1) * d]
                if i == len(ids) - 1:
                    got = np.array(loaded.model.model.norm(mx.array(got)))
                err = np.abs(got - want).max() / np.abs(want).max()
                assert err <= 1e-5, (type(runner.stack).__name__, i, float(err))
