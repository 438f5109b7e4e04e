"""Model loading: tiny random-weight HF folders of several mlx-lm architectures, GGUF vs converted
folder, and Hub ids resolved offline from a local cache (nothing is downloaded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.llm import LLM
from engine.models.loader import default_gguf_path, default_model_folder, load_model
from engine.sampling import SamplingParams
from tests.helpers import CHATS, default_model, hub_repo, reference_greedy, run_offline

VOCAB = 49152  # reuse SmolLM2's tokenizer files

TINY = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "max_position_embeddings": 512},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 1e6,
              "tie_word_embeddings": True, "max_position_embeddings": 512},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
              "rope_theta": 1e6, "tie_word_embeddings": True, "max_position_embeddings": 512},
    "gemma3_text": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 64,
                    "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
                    "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 32,
                    "sliding_window": 8, "sliding_window_pattern": 2, "max_position_embeddings": 512},
}


def make_tiny_folder(arch: str, root: Path, seed: int = 0) -> Path:
    from mlx_lm.utils import _get_classes

    config = TINY[arch]
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Larger random weights make logits peaky, so greedy choices are far from ties.
    params = [(k, v * 4.0 if v.ndim == 2 else v) for k, v in tree_flatten(model.parameters())]
    out = root / f"tiny-{arch}"
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(params), metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    src = default_model_folder(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


@pytest.mark.parametrize("arch", list(TINY))
def test_hf_folder_architectures_match_mlx_lm(arch: str, tmp_path: Path) -> None:
    folder = make_tiny_folder(arch, tmp_path)
    loaded = load_model(str(folder), dtype="float32", progress=False)
    assert loaded.source == "folder" and loaded.config["model_type"] == arch
    llm = LLM(loaded=loaded, kv_cache_memory="64MiB", max_model_len=512, block_size=8, show_progress=False)
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in CHATS[:4]]
    assert max(len(p) for p in prompts) > 2 * 8  # past the gemma3 sliding window and several blocks
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference_greedy(loaded, p, 12)
    assert llm.core.kv.num_free_blocks == llm.core.kv.pool.num_blocks


def test_cpu_swiglu_is_the_power_of_two_form_and_agrees_with_mlx_lm() -> None:
    import mlx.nn as nn
    from mlx_lm.models import llama

    from engine.models import adapter

    adapter.install(default_model().model)  # what every ModelRunner does
    assert llama.swiglu is adapter.swiglu_pow2
    mx.random.seed(3)
    gate = mx.random.normal((5, 1536)) * 8.0  # past the flat ends of the sigmoid both ways
    x = mx.random.normal((5, 1536))
    want = nn.silu(gate) * x
    got = adapter.swiglu_pow2(gate, x)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()


def test_gemma3_sliding_window_is_applied(tmp_path: Path) -> None:
    # With the window ignored, outputs differ from mlx-lm's (which applies it): guard the guard.
    from engine.models import adapter

    folder = make_tiny_folder("gemma3_text", tmp_path)
    loaded = load_model(str(folder), dtype="float32", progress=False)
    assert adapter.layer_windows(loaded.model) == [8, None, 8, None]


def test_gguf_direct_equals_converted_folder() -> None:
    gguf = load_model(str(default_gguf_path()), dtype="float32", progress=False)
    assert gguf.source == "gguf"
    folder = default_model()
    assert folder.source == "default"
    llm_g = LLM(loaded=gguf, kv_cache_memory="256MiB", max_model_len=1024, show_progress=False)
    llm_f = LLM(loaded=folder, kv_cache_memory="256MiB", max_model_len=1024, show_progress=False)
    msgs = [[{"role": "user", "content": t}] for t in CHATS[:3]]
    pg = [llm_g.apply_chat_template(m) for m in msgs]
    pf = [llm_f.apply_chat_template(m) for m in msgs]
    assert pg == pf  # same tokenizer and chat template from the GGUF metadata
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    assert [o.token_ids for o in llm_g.generate(pg, sp)] == [o.token_ids for o in llm_f.generate(pf, sp)]
    assert gguf.eos_token_ids == folder.eos_token_ids


def test_dtype_float32_dequantizes_on_cpu() -> None:
    loaded = default_model()
    assert loaded.dtype == mx.float32 and loaded.precision == "float32"
    assert loaded.model.model.layers[0].mlp.up_proj.weight.dtype == mx.float32


def test_hub_id_resolves_offline_from_local_cache(tmp_path: Path) -> None:
    folder = make_tiny_folder("qwen3", tmp_path / "src")
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_repo(cache, "specserve-test/tiny-qwen3", {commit: folder}, {"main": commit})
    snap = repo / "snapshots" / commit
    code = (
        "import engine\n"
        "from engine.models.loader import load_model\n"
        "from engine.llm import LLM\n"
        "from engine.sampling import SamplingParams\n"
        "m = load_model('specserve-test/tiny-qwen3', dtype='float32', progress=False)\n"
        "llm = LLM(loaded=m, kv_cache_memory='32MiB', max_model_len=256, show_progress=False)\n"
        "o = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))\n"
        "print(m.source, m.path, o[0].token_ids)\n")
    lines = run_offline(code, cache, tmp_path / "home", timeout=120)
    source, path, toks = lines[-1].split(" ", 2)
    assert source == "hub" and Path(path) == snap
    local = load_model(str(folder), dtype="float32", progress=False)
    llm = LLM(loaded=local, kv_cache_memory="32MiB", max_model_len=256, show_progress=False)
    o = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert toks == str(o[0].token_ids)


def test_unknown_model_path_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_model(str(tmp_path / "nope" / "deeper" / "x"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path / "empty"), progress=False)
