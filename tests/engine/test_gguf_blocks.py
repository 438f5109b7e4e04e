"""GGML block weights served as stored (engine/cpu/blocks.h): a tiny llama GGUF whose matrices are Q5_0,
Q5_1, Q4_K, Q5_K and Q6_K keeps them as the file's bytes, runs them through the C layers with 8-bit
activations, and stays exact: greedy speculation equals plain decoding alone and batched; with float32
activations it decodes exactly as the float32 weights the gguf package dequantizes."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine.cpu.qgemm import BlockWeights, unsupported_reason
from engine.llm import LLM
from engine.models.gguf import read_gguf
from engine.models.gguf_file import read_file
from engine.models.loader import LoadedModel, load_model
from engine.models.weights import CpuEmbedding, CpuLinear
from engine.sampling import SamplingParams
from tests.engine.test_gguf_kquants import _write

WHY = unsupported_reason()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no C kernels here: {WHY}")
LAYERS = [QT.Q4_K, QT.Q5_0, QT.Q6_K, QT.Q5_1, QT.Q5_K]
KW = dict(kv_cache_memory="64MiB", max_model_len=256, show_progress=False)
PROMPTS = [[1, 5, 9, 12, 7, 5, 9, 12, 3], [2, 40, 41, 42, 43, 40, 41], [7] * 12, [9, 3, 9, 3, 9, 3, 8]]


@functools.cache
def _path(tmp: str) -> Path:
    path = Path(tmp) / "blocks.gguf"
    _write(path, QT.Q6_K, LAYERS)  # a Q6_K embedding: the tied head too
    return path


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _path(str(tmp_path_factory.mktemp("blocks")))


@pytest.fixture(scope="module")
def stored(path: Path) -> LoadedModel:
    return load_model(str(path), progress=False)


def test_block_matrices_are_the_files_bytes(path: Path) -> None:
    model = read_gguf(path)
    blocks = model.config["gguf_blocks"]
    assert blocks["model.embed_tokens"] == "Q6_K"
    assert set(blocks.values()) == {q.name for q in LAYERS}
    _, tensors = read_file(path)
    down = tensors["blk.1.ffn_down.weight"]  # rows not permuted: byte for byte
    np.testing.assert_array_equal(np.array(model.weights["model.layers.1.mlp.down_proj.weight"]), down.data)
    assert blocks["model.layers.1.mlp.down_proj"] == down.qtype.name


def test_served_as_blocks_through_the_c_layers(stored: LoadedModel) -> None:
    mods = [m for _, m in stored.model.named_modules() if isinstance(m, (CpuLinear, CpuEmbedding))]
    assert mods and all(isinstance(m._packed, BlockWeights) for m in mods)
    assert stored.precision == "Q4_K + Q5_0 + Q5_1 + Q5_K + Q6_K"
    llm = LLM(loaded=stored, **KW)
    assert llm.core.runner.stack is not None  # the C layers, not MLX modules


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_speculation_equals_plain_alone_and_batched(stored: LoadedModel, path: Path,
                                                           method: str) -> None:
    cfg: dict = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        cfg.update(prompt_lookup_min=1, prompt_lookup_max=3)
    else:  # the target drafting for itself: every draft accepted, verification rows batched
        cfg.update(model=str(path), draft_sample_method="greedy")
    plain, spec = LLM(loaded=stored, **KW), LLM(loaded=stored, speculative_config=cfg, **KW)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(PROMPTS, greedy)]
    alone = [spec.generate([p], greedy)[0] for p in PROMPTS[:2]]
    assert [o.token_ids for o in alone] == want[:2]
    batched = spec.generate(PROMPTS * 2, greedy)
    assert [o.token_ids for o in batched] == want * 2
    accepted = sum(o.spec_num_accepted_tokens for o in [*alone, *batched])
    assert accepted > 0, "no draft accepted: nothing tested"


def test_float32_activations_decode_as_the_dequantized_weights(stored: LoadedModel, path: Path) -> None:
    exact = LLM(loaded=stored, activation_precision="float32", **KW)
    lin = next(m for _, m in stored.model.named_modules() if isinstance(m, CpuLinear))
    assert lin.precision == "float32"
    floats = load_model(str(path), dtype="float32", progress=False)  # the gguf package's values
    assert not any(isinstance(m, (CpuLinear, CpuEmbedding)) and isinstance(m._packed, BlockWeights)
                   for _, m in floats.model.named_modules())
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(loaded=floats, **KW).generate(PROMPTS, greedy)]
    assert [o.token_ids for o in exact.generate(PROMPTS, greedy)] == want
    # 8-bit activations change some logits' last bits, not the model: most tokens agree.
    int8 = LLM(loaded=stored, activation_precision="auto", **KW)
    assert lin.precision.startswith("Q")
    got = [o.token_ids for o in int8.generate(PROMPTS, greedy)]
    agree = np.mean([a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)])
    assert agree >= 0.5, agree


def test_int8_refused_only_without_block_or_4bit_weights(stored: LoadedModel, path: Path) -> None:
    LLM(loaded=stored, activation_precision="int8", **KW)
    with pytest.raises(ValueError, match="needs 4-bit weights"):
        LLM(loaded=load_model(str(path), dtype="float32", progress=False), activation_precision="int8", **KW)
