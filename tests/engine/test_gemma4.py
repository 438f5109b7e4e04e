"""Gemma4 targets as published, on the paged cache: tiny random-weight models built with transformers' own
classes from configs that keep every structural feature of the published E2B, E4B and 31B text configs,
scaled down in width and depth. Their logits equal transformers' float32 forward and mlx-lm's own (its
KVCache / RotatingKVCache) at every position of one-shot, chunked-and-batched, prefix-hit and decode
steps; batched greedy decoding with chunked prefill, prefix hits and preemption equals one-request
decoding; a layer reading the wrong cache fails these checks.

The published structure (config.json `text_config`, read from public copies of the configs):
| field | E2B | E4B | 31B | tiny kept |
|---|---|---|---|---|
| layers, sliding : full | 35, 4 : 1 | 42, 5 : 1 | 60, 5 : 1 | 10 (4:1), 12 (5:1), 6 (2:1) |
| head_dim / global_head_dim | 256 / 512 | 256 / 512 | 256 / 512 | 16 / 32 |
| KV heads / global KV heads | 1 / - | 2 / - | 16 / 4 (attention_k_eq_v) | 1 / -, 2 / -, 4 / 2 (k_eq_v) |
| num_kv_shared_layers | 20 | 18 | 0 | 4, 4, 0 |
| hidden_size_per_layer_input | 256 | 256 | 0 | 8, 8, 0 |
| use_double_wide_mlp | true | false | false | true, false, false |
| full-layer RoPE | proportional, 0.25 of dims | same | same | same |
| sliding_window, softcap, tied head | 512, 30, yes | 512, 30, yes | 1024, 30, yes | 8, 30, yes |
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.cache import PagedKVCache
from engine.llm import LLM
from engine.models import adapter
from engine.models.loader import load_model
from engine.sampling import SamplingParams
from tests.helpers import CHATS, save_with_default_tokenizer, scale_weights

torch = pytest.importorskip("torch", reason="torch (a test-only dependency: pip install torch==2.13.0) "
                                            "is needed to build the transformers reference models")
transformers = pytest.importorskip("transformers")

VOCAB = 49152  # SmolLM2's tokenizer files
S, F = "sliding_attention", "full_attention"
KINDS: dict[str, dict[str, Any]] = {
    "e2b": dict(layer_types=([S] * 4 + [F]) * 2, num_attention_heads=4, num_key_value_heads=1,
                num_kv_shared_layers=4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                use_double_wide_mlp=True),
    "e4b": dict(layer_types=([S] * 5 + [F]) * 2, num_attention_heads=4, num_key_value_heads=2,
                num_kv_shared_layers=4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                use_double_wide_mlp=False),
    "31b": dict(layer_types=[S, S, F] * 2, num_attention_heads=8, num_key_value_heads=4,
                num_global_key_value_heads=2, attention_k_eq_v=True, num_kv_shared_layers=0,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, use_double_wide_mlp=False),
}
HEAD_DIM, GLOBAL_HEAD_DIM, WINDOW = 16, 32, 8


def make_gemma4(folder: Path, kind: str, seed: int = 0) -> Any:
    """A tiny `gemma4_text` target of the published `kind`'s structure, saved with SmolLM2's tokenizer."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    kw = dict(KINDS[kind])
    cfg = Gemma4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=len(kw["layer_types"]), head_dim=HEAD_DIM,
                           global_head_dim=GLOBAL_HEAD_DIM, sliding_window=WINDOW,
                           final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1, bos_token_id=2, **kw)
    model = Gemma4ForCausalLM(cfg).eval()
    scale_weights(model)
    save_with_default_tokenizer(model, folder)  # the config exactly as transformers writes it
    return model


@pytest.fixture(scope="module", params=list(KINDS))
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    folder = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    return request.param, folder, make_gemma4(folder, request.param)


def _prompts(tokenizer: Any) -> list[list[int]]:
    # Past the sliding window of 8 (the first two) and within it (the third).
    return [tokenizer.encode(CHATS[3])[:29], tokenizer.encode(CHATS[5])[:23], tokenizer.encode(CHATS[1])[:6]]


def _reference(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _logits(core: EngineCore, chunks: list[tuple[list[int], int, list[int]]]) -> list[np.ndarray]:
    """One step over `chunks` (tokens, start position, block table): each chunk's logits."""
    h = core.runner.forward_chunks([(t, s, b, len(t)) for t, s, b in chunks])
    out = np.array(adapter.compute_logits(core.runner.model, h))
    ends = np.cumsum([len(t) for t, _, _ in chunks])
    return np.split(out, ends[:-1])


def _core(loaded: Any, **kw: Any) -> EngineCore:
    config = EngineConfig(kv_cache_memory="16MiB", max_model_len=256, block_size=4, show_progress=False, **kw)
    return EngineCore(config, loaded)


def _check_steps(core: EngineCore, prompts: list[list[int]], want: list[np.ndarray]) -> float:
    """Worst relative error against `want` over one-shot, chunked-with-a-neighbour, prefix-hit and
    one-token decode steps (block tables laid out by hand, block size 4)."""
    a, b, c = prompts
    errs: list[float] = []

    def err(got: np.ndarray, ref: np.ndarray) -> None:
        errs.append(float(np.abs(got - ref).max() / np.abs(ref).max()))

    t_a, t_b, t_c = list(range(0, 8)), list(range(8, 14)), list(range(14, 16))
    (whole,) = _logits(core, [(a, 0, t_a)])
    err(whole, want[0])
    # b in chunks of 5, each step beside c's prefill or decode: chunk boundaries cross blocks and windows.
    got_b: list[np.ndarray] = []
    for start in range(0, len(b), 5):
        step = [(b[start:start + 5], start, t_b)]
        if start == 0:
            step.append((c[:-1], 0, t_c))
        elif start // 5 <= 1:
            step.append(([c[-1]], len(c) - 1, t_c))
        outs = _logits(core, step)
        got_b.append(outs[0])
        if start == 0:
            err(outs[1], want[2][:-1])
        elif start // 5 <= 1:
            err(outs[1], want[2][-1:])
    err(np.concatenate(got_b), want[1])
    # Prefix hit: a request whose first 16 tokens are a's reuses a's first 4 blocks and computes the rest.
    hit = a[:16] + b[:9]
    (tail,) = _logits(core, [(hit[16:], 16, t_a[:4] + list(range(16, 19)))])
    err(tail, want[3][16:])
    return max(errs)


def test_layout_is_per_layer(target: tuple[str, Path, Any]) -> None:
    kind, folder, _ = target
    loaded = load_model(str(folder), dtype="float32", progress=False)
    kw = KINDS[kind]
    types, n_shared = kw["layer_types"], kw["num_kv_shared_layers"]
    layout = adapter.kv_layout(loaded.model)
    first_shared = len(types) - n_shared
    full_kv = kw.get("num_global_key_value_heads", kw["num_key_value_heads"])
    for i, t in enumerate(types):
        if i >= first_shared:  # reads the last storing layer of its type
            assert layout.shapes[i] is None
            assert layout.sources[i] == max(j for j in range(first_shared) if types[j] == t)
        else:
            assert layout.sources[i] == i
            assert layout.shapes[i] == ((full_kv, GLOBAL_HEAD_DIM) if t == F else (kw["num_key_value_heads"],
                                                                                  HEAD_DIM))
        assert layout.windows[i] == (WINDOW if t == S else None)
    per_block = PagedKVCache.bytes_per_block(layout.shapes, 4, mx.float32)
    assert per_block == sum(2 * 4 * n * d * 4 for n, d in (s for s in layout.shapes if s is not None))
    core = _core(loaded)
    assert core.kv_cache.nbytes == per_block * core.kv.pool.num_blocks
    assert core.runner.stack is None  # MLX modules (the C layers are llama / qwen)


def test_logits_equal_transformers_and_mlx_lm(target: tuple[str, Path, Any]) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    kind, folder, reference = target
    loaded = load_model(str(folder), dtype="float32", progress=False)
    prompts = _prompts(loaded.tokenizer)
    hit = prompts[0][:16] + prompts[1][:9]
    want = [_reference(reference, ids) for ids in [*prompts, hit]]
    # mlx-lm's own forward (its KV and rotating caches, not paged) agrees with transformers first.
    for ids, ref in zip([*prompts, hit], want, strict=True):
        ours = np.array(loaded.model(mx.array([ids]), cache=make_prompt_cache(loaded.model))[0])
        assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max(), kind
    assert _check_steps(_core(loaded), prompts, want) <= 1e-4
    # The check can fail: logits one position off are far from the reference.
    assert np.abs(want[0][1:] - want[0][:-1]).max() > 100 * 1e-4 * np.abs(want[0]).max()


def test_a_layer_reading_the_wrong_cache_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "e2b"
    reference = make_gemma4(folder, "e2b")
    loaded = load_model(str(folder), dtype="float32", progress=False)
    prompts = _prompts(loaded.tokenizer)
    want = [_reference(reference, ids) for ids in [*prompts, prompts[0][:16] + prompts[1][:9]]]
    right = adapter.kv_layout(loaded.model)

    # KV-shared layers pointed at caches of their own (same shapes, never written: empty).
    def with_own_tensors(model: Any) -> adapter.KVLayout:
        shapes = [s if s is not None else right.shapes[right.sources[i]] for i, s in enumerate(right.shapes)]
        return adapter.KVLayout(shapes, right.sources, right.windows)

    monkeypatch.setattr(adapter, "kv_layout", with_own_tensors)
    own = _core(loaded)
    for i, c in enumerate(own.runner.caches):
        if not c.writes:
            c.layer = i
    assert _check_steps(own, prompts, want) > 1e-2

    # Full-attention layers given the sliding layers' head size: their KV does not fit its cache.
    def narrow(model: Any) -> adapter.KVLayout:
        return adapter.KVLayout([(s[0], HEAD_DIM) if s is not None else None for s in right.shapes],
                                right.sources, right.windows)

    monkeypatch.setattr(adapter, "kv_layout", narrow)
    with pytest.raises(ValueError, match="broadcast"):
        _check_steps(_core(loaded), prompts, want)


def test_batched_greedy_with_chunks_prefix_hits_and_preemption(target: tuple[str, Path, Any]) -> None:
    kind, folder, reference = target
    loaded = load_model(str(folder), dtype="float32", progress=False)
    prompts = _prompts(loaded.tokenizer)
    prompts = prompts + [prompts[0][:20] + prompts[2]]  # shares a's first blocks: a prefix hit
    n = 12
    want = []
    for ids in prompts:  # transformers, one request, whole sequence each step
        seq = list(ids)
        for _ in range(n):
            seq.append(int(np.argmax(_reference(reference, seq)[-1])))
        want.append(seq[len(ids):])
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    layout = adapter.kv_layout(loaded.model)
    per_block = PagedKVCache.bytes_per_block(layout.shapes, 4, mx.float32)
    for kw in (dict(kv_cache_memory="16MiB", max_num_batched_tokens=7),  # chunked prefill
               dict(kv_cache_memory=str(20 * per_block))):  # 20 blocks of 4 for 4 requests: preemption
        llm = LLM(loaded=loaded, max_model_len=64, block_size=4, show_progress=False, **kw)
        outs = llm.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == want, (kind, kw)
        core = llm.core
        assert core.kv.num_free_blocks == core.kv.pool.num_blocks
        if "max_num_batched_tokens" in kw:
            assert sum(o.num_cached_tokens for o in outs) >= 16, [o.num_cached_tokens for o in outs]
        else:
            assert core.scheduler.num_preemptions > 0


def test_the_multimodal_wrapper_serves_its_text_model(tmp_path: Path) -> None:
    """Published checkpoints are `gemma4` (text_config + language_model weights): served as the text model."""
    text = tmp_path / "text"
    reference = make_gemma4(text, "e2b")
    wrapped = tmp_path / "wrapped"
    shutil.copytree(text, wrapped)
    cfg = json.loads((text / "config.json").read_text())
    outer = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "vocab_size": VOCAB,
             "text_config": cfg, "eos_token_id": cfg["eos_token_id"]}
    (wrapped / "config.json").write_text(json.dumps(outer))
    weights = {k.replace("model.", "model.language_model.", 1): v
               for k, v in mx.load(str(text / "model.safetensors")).items()}
    mx.save_safetensors(str(wrapped / "model.safetensors"), weights)
    loaded = load_model(str(wrapped), dtype="float32", progress=False)
    assert loaded.config["model_type"] == "gemma4" and loaded.max_position_embeddings == cfg[
        "max_position_embeddings"]
    ids = _prompts(loaded.tokenizer)[0]
    (got,) = _logits(_core(loaded), [(ids, 0, list(range(8)))])
    want = _reference(reference, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("override, match", [
    ({"0": {"head_dim": 32}}, "sliding layer 0"),
    ({"4": {"head_dim": 32, "rope_theta": 5.0}}, "rope_theta"),
    ({"4": {"head_dim": 32}, "9": {"head_dim": 64}}, "different shapes"),
    ({"4": {"num_key_value_heads": 2}, "9": {"num_key_value_heads": 2}}, "without attention_k_eq_v"),
])
def test_per_layer_config_beyond_mlx_lm_is_refused(tmp_path: Path, override: dict, match: str) -> None:
    from transformers import Gemma4TextConfig

    kw = dict(KINDS["e2b"])
    Gemma4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=10,
                     head_dim=HEAD_DIM, global_head_dim=GLOBAL_HEAD_DIM, **kw).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["per_layer_config"] and "global_head_dim" not in cfg  # what transformers writes
    cfg["per_layer_config"] = override
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path), dtype="float32", progress=False)
