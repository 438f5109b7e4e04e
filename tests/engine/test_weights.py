"""Weights served in their own precision (engine/models/weights.py) and the C decoder layers
(engine/cpu/layers.c): the default Q4_1 GGUF served as 4-bit gives MLX's own quantized_matmul logits,
the C layers give the MLX modules' hidden states and are batch-invariant, greedy speculative output
equals plain decoding at every precision, and --quantization q4 agrees with float32 greedy."""

from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cpu import qgemm
from engine.cpu.qgemm import PackedWeights
from engine.llm import LLM
from engine.models.loader import LoadedModel, default_model_folder, load_model
from engine.models.weights import CpuEmbedding, CpuLinear, precision_name
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.helpers import CHATS, default_model

WHY = qgemm.unsupported_reason()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"low-precision CPU kernel cannot run here: {WHY}")
COPY = ("Repeat the following list exactly, twice: apples, pears, plums, figs, dates, limes, kiwis, "
        "grapes, melons, cherries.")


@functools.cache
def loaded_auto() -> LoadedModel:
    return load_model(None, dtype="auto", progress=False)


def _prompts(loaded: LoadedModel, texts: list[str]) -> list[list[int]]:
    return [loaded.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for t in texts]


def _core(loaded: LoadedModel, activation_precision: str = "auto") -> EngineCore:
    return EngineCore(EngineConfig(kv_cache_memory="128MiB", max_model_len=1024, show_progress=False,
                                   activation_precision=activation_precision), loaded)


def _forward(core: EngineCore, chunks: list[tuple[list[int], int, list[int]]], use_stack: bool) -> np.ndarray:
    """Hidden states at every position of one step over `chunks` (tokens, start, block table)."""
    runner = core.runner
    if not use_stack:  # the same model and cache through MLX's modules
        runner = ModelRunner(runner.model, runner.kv, runner.caches[0].attention_fn)
    h = runner.forward_chunks([(t, s, b, len(t)) for t, s, b in chunks])
    return np.array(adapter_logits(core, h))


def adapter_logits(core: EngineCore, h: mx.array) -> mx.array:
    from engine.models import adapter

    return adapter.compute_logits(core.runner.model, h)


@needs_kernel
def test_default_model_is_served_as_stored() -> None:
    loaded = loaded_auto()
    assert loaded.dtype == mx.float32  # compute dtype
    assert loaded.precision == "q4 (group 32) + q8 (group 32)"
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.mlp.up_proj, CpuLinear) and layer.mlp.up_proj["weight"].dtype == mx.uint32
    assert isinstance(loaded.model.model.embed_tokens, CpuEmbedding)  # the tied head reads the same table
    assert layer.input_layernorm.weight.dtype == mx.float32
    assert default_model().precision == "float32"


@needs_kernel
def test_q4_logits_equal_mlx_quantized_matmul_on_the_same_triples() -> None:
    """The GGUF's own integers, served by the C kernels, against mlx-lm's model with MLX's quantized
    matmul (float32 scales, no paged cache) at every position of the prompt."""
    from mlx_lm.utils import load_model as mlx_load_model

    loaded = loaded_auto()
    ref, _ = mlx_load_model(default_model_folder(progress=False))
    ref.set_dtype(mx.float32)  # scales, biases and norms; the packed integers stay
    assert isinstance(ref.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    core = _core(loaded, "float32")  # float activations: the product MLX computes
    assert core.runner.stack is not None
    ids = _prompts(loaded, [CHATS[0]])[0]
    ours = _forward(core, [(ids, 0, list(range(8)))], use_stack=True)
    theirs = np.array(ref(mx.array([ids]))[0])
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= 2e-3 * scale
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.95
    # 8-bit activations (the default on AVX2): near it, not equal.
    int8 = _forward(_core(loaded, "int8"), [(ids, 0, list(range(8)))], use_stack=True)
    assert not np.array_equal(int8, ours)
    assert np.abs(int8 - theirs).max() <= 0.1 * scale
    # The check can fail: a model whose scales are off by one group is far from it.
    wrong = np.abs(ours - np.roll(theirs, 1, axis=-1)).max()
    assert wrong > 100 * 2e-3 * scale


@needs_kernel
@pytest.mark.parametrize("precision", ["float32", "auto"])
def test_c_layers_equal_mlx_modules_batched_and_chunked(precision: str) -> None:
    loaded = default_model() if precision == "float32" else loaded_auto()
    core = _core(loaded, "float32")  # float activations: the arithmetic MLX's modules do
    assert core.runner.stack is not None, "the C layers should run for the default model here"
    a, b, c = _prompts(loaded, CHATS[:3])
    split = len(a) // 2
    results = {}
    for use_stack in (True, False):
        first = _forward(core, [(a[:split], 0, list(range(0, 8))), (b, 0, list(range(8, 16))),
                                (c, 0, list(range(16, 24)))], use_stack)
        second = _forward(core, [(a[split:], split, list(range(0, 8)))], use_stack)  # a chunked prefill
        results[use_stack] = np.concatenate([first, second])
    c_out, mlx_out = results[True], results[False]
    scale = np.abs(mlx_out).max()
    assert np.abs(c_out - mlx_out).max() <= 2e-3 * scale
    assert (c_out.argmax(-1) == mlx_out.argmax(-1)).mean() >= 0.95


@needs_kernel
@pytest.mark.parametrize("precision,activations",
                         [("float32", "auto"), ("auto", "float32"), ("auto", "int8")])
def test_c_layers_are_bitwise_batch_invariant(precision: str, activations: str) -> None:
    """A request's logits alone, beside two others, and as verification rows are the same bits."""
    loaded = default_model() if precision == "float32" else loaded_auto()
    core = _core(loaded, activations)
    a, b, c = _prompts(loaded, CHATS[:3])
    alone = _forward(core, [(a, 0, list(range(0, 8)))], use_stack=True)
    batched = _forward(core, [(b, 0, list(range(8, 16))), (a, 0, list(range(0, 8))),
                              (c, 0, list(range(16, 24)))], use_stack=True)
    assert np.array_equal(alone, batched[len(b) : len(b) + len(a)])
    # The last 5 tokens again as one 5-row step (what verification computes) vs one at a time.
    n = len(a)
    rows = _forward(core, [(a[n - 5 :], n - 5, list(range(0, 8)))], use_stack=True)
    singles = np.concatenate([_forward(core, [(a[i : i + 1], i, list(range(0, 8)))], use_stack=True)
                              for i in range(n - 5, n)])
    assert np.array_equal(rows, singles)
    assert np.array_equal(rows, alone[n - 5 :])
    # 9 rows: the 2 x 12 blocks (a step of 8 concurrent decodes takes them).
    nine = _forward(core, [(a[n - 9 :], n - 9, list(range(0, 8)))], use_stack=True)
    assert np.array_equal(nine, alone[n - 9 :])


@needs_kernel
def test_greedy_speculation_equals_plain_decoding_at_q4() -> None:
    loaded = loaded_auto()
    prompts = _prompts(loaded, [COPY, *CHATS[:3]])
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = LLM(loaded=loaded, kv_cache_memory="128MiB", max_model_len=1024, show_progress=False)
    spec = LLM(loaded=loaded, kv_cache_memory="128MiB", max_model_len=1024, show_progress=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                   "prompt_lookup_max": 4})
    want = [plain.generate([p], sp)[0].token_ids for p in prompts]  # alone
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want  # batched, with drafts
    assert [spec.generate([p], sp)[0].token_ids for p in prompts] == want  # alone, with drafts
    assert spec.core.kv.num_free_blocks == spec.core.kv.pool.num_blocks


def _first_token_ranks(loaded: LoadedModel, reference: list[int], prompts: list[list[int]]) -> list[int]:
    """Per prompt: how many tokens score above float32's greedy first token in `loaded`'s logits."""
    core = _core(loaded)
    ranks = []
    for p, r in zip(prompts, reference, strict=True):
        last = _forward(core, [(p, 0, list(range(8)))], use_stack=True)[-1]
        ranks.append(int((last > last[r]).sum()))
    return ranks


@needs_kernel
def test_quantization_agrees_with_float32_greedy_and_a_broken_layout_does_not() -> None:
    """`--quantization q8|q4` (MLX's quantizer, group 64) of the float32 checkpoint against float32's
    greedy first token on 8 prompts. Thresholds (measured 2026-11-27; MLX's own quantized matmul gives
    the same agreement): q8 picks the same token on >= 7 of 8; q4 of this 135M model ranks it among its
    4 best on >= 6 of 8. Scales read in the wrong order fail the q4 threshold."""
    f32 = default_model()
    prompts = _prompts(f32, CHATS[:8])
    core = _core(f32)
    reference = [int(_forward(core, [(p, 0, list(range(8)))], use_stack=True)[-1].argmax()) for p in prompts]
    q8 = load_model(None, dtype="float32", quantization="q8", progress=False)
    assert sum(r == 0 for r in _first_token_ranks(q8, reference, prompts)) >= 7
    q4 = load_model(None, dtype="float32", quantization="q4", progress=False)
    assert q4.precision == "q4 (group 64)"
    assert sum(r < 4 for r in _first_token_ranks(q4, reference, prompts)) >= 6
    for _, m in q4.model.named_modules():  # every row's group scales reversed
        if isinstance(m, (CpuLinear, CpuEmbedding)):
            pw = m._packed
            m._packed = PackedWeights.affine(pw.arrays[0], mx.contiguous(pw.arrays[1][:, ::-1]), pw.arrays[2],
                                             pw.group, 4)
    assert sum(r < 4 for r in _first_token_ranks(q4, reference, prompts)) < 6


@needs_kernel
@pytest.mark.parametrize(("dtype", "quantization", "want"), [
    ("bfloat16", None, "bf16"), ("float16", None, "f16"), ("auto", "q8", "q8 (group 64)"),
    ("float32", None, "float32")])
def test_precisions_of_the_default_model(dtype: str, quantization: str | None, want: str) -> None:
    loaded = load_model(None, dtype=dtype, quantization=quantization, progress=False)  # type: ignore[arg-type]
    assert loaded.precision == want
    assert loaded.dtype == mx.float32  # activations and KV cache, whatever the weights
    llm = LLM(loaded=loaded, kv_cache_memory="64MiB", max_model_len=512, show_progress=False)
    assert llm.core.runner.stack is not None  # the C layers and attention run at every precision
    out = llm.generate(_prompts(loaded, [COPY]), SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert "apples" in loaded.tokenizer.decode(out.token_ids)


def test_prepare_writes_a_quantized_folder_through_mlx_lm(tmp_path: Path) -> None:
    from engine.models.loader import quantized_copy
    from tests.engine.test_models import make_tiny_folder

    src = make_tiny_folder("llama", tmp_path / "src")
    out = quantized_copy(str(src), "q4", out=str(tmp_path / "q4"))
    loaded = load_model(str(out), dtype="auto", progress=False)
    assert loaded.config["quantization"]["bits"] == 4
    assert "q4 (group 64)" in precision_name(loaded.model)
    with pytest.raises(ValueError, match="already quantized"):
        quantized_copy(None, "q4")


@needs_kernel
def test_quantizing_a_quantized_checkpoint_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    loaded = load_model(None, dtype="auto", quantization="q8", progress=False)
    assert loaded.precision == "q8 (group 64)"
    assert "dequantized, then quantized again" in caplog.text


@needs_kernel
def test_draft_quantization_is_its_own() -> None:
    """The speculative config's `quantization` (vLLM's key) quantizes the draft, not the target."""
    from engine.spec.config import parse_speculative_config
    from engine.spec.factory import load_draft

    target = default_model()
    folder = str(default_model_folder(progress=False))
    spec = parse_speculative_config({"method": "draft_model", "model": folder, "num_speculative_tokens": 2,
                                     "quantization": "q8"})
    draft = load_draft(spec, target, "float32", progress=False)
    assert draft is not None and draft is not target
    assert draft.precision == "q8 (group 64)" and target.precision == "float32"
