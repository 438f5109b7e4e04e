"""gemma3 and gemma4 GGUF files, written as llama.cpp's converter (convert_hf_to_gguf.py) writes them: the
metadata calls it makes, the tensor names the `gguf` package's own HF -> GGUF map gives (an independent
table from the loader's), gemma3's norms stored as 1 + w, gemma4's per-layer lists (attention type, KV
heads, MLP width) and its partial-rotary `rope_freqs`. Each file, loaded by specserve, gives transformers'
float32 logits at every position, and its tokenizer (gemma4's own kind, sentencepiece-style BPE with
merges) encodes as the Hugging Face tokenizer it came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.models import adapter
from engine.models.loader import load_model
from tests.helpers import scale_weights

torch = pytest.importorskip("torch", reason="torch (a test-only dependency: pip install torch==2.13.0) "
                                            "is needed to build the transformers reference models")
transformers = pytest.importorskip("transformers")

PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "ll", "▁h", "▁he", "or", "▁w", "▁wor", "▁hell", "▁hello",
          "ld", "▁world"]
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
# llama.cpp's token types: 1 normal, 2 unknown, 3 control, 6 byte.
TYPES = [3, 3, 3, 2] + [6] * 256 + [1] * len(PIECES)
TEXT = "hello world hello, hello wor é"


def _merges() -> list[tuple[str, str]]:
    ids = {t: i for i, t in enumerate(TOKENS)}
    found = [(ids[p], p[:c], p[c:]) for p in PIECES for c in range(1, len(p))
             if p[:c] in ids and p[c:] in ids]
    return [(a, b) for _, a, b in sorted(found)]


def _hf_tokenizer(folder: Path) -> None:
    """The sentencepiece-style BPE tokenizer.json that Gemma checkpoints ship (byte fallback, spaces as ▁)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(TOKENS)}, _merges(), unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True) for t in TOKENS[:4]])
    tok.post_processor = processors.TemplateProcessing(single="<bos>:0 $A:0", special_tokens=[("<bos>", 2)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "unk_token": "<unk>", "pad_token": "<pad>"}))


def _model(kind: str) -> Any:
    torch.manual_seed(0)
    common = dict(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=96, head_dim=16, sliding_window=8,
                  max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if kind == "gemma3":  # llama.cpp takes every sixth layer as global
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                            layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                            query_pre_attn_scalar=16, **common)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        from tests.engine.test_gemma4 import GLOBAL_HEAD_DIM, KINDS

        kw = dict(KINDS[kind])
        if kw["hidden_size_per_layer_input"]:
            kw["vocab_size_per_layer_input"] = len(TOKENS)
        cfg = transformers.Gemma4TextConfig(num_hidden_layers=len(kw["layer_types"]),
                                            global_head_dim=GLOBAL_HEAD_DIM, final_logit_softcapping=30.0,
                                            **common, **kw)
        model = transformers.Gemma4ForCausalLM(cfg)
    model.eval()
    scale_weights(model)
    with torch.no_grad():  # norms away from their initial values, so that a missed +1 shows
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def write_gguf(model: Any, path: Path, kind: str) -> None:
    """What convert_hf_to_gguf.py's Gemma3Model / Gemma4Model write for this model (F32 tensors)."""
    cfg = model.config
    arch = gguf.MODEL_ARCH.GEMMA3 if kind == "gemma3" else gguf.MODEL_ARCH.GEMMA4
    n = cfg.num_hidden_layers
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    extra: dict[str, np.ndarray] = {}
    if kind == "gemma3":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    else:
        from tests.engine.test_gemma4 import GLOBAL_HEAD_DIM, HEAD_DIM, KINDS

        # transformers keeps head sizes and KV heads per layer (per_layer_config): read them from the kind.
        types, kv = list(cfg.layer_types), KINDS[kind]["num_key_value_heads"]
        full_dim = GLOBAL_HEAD_DIM
        first_shared = n - cfg.num_kv_shared_layers
        w.add_shared_kv_layers(cfg.num_kv_shared_layers)
        w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        w.add_key_length(full_dim)
        w.add_value_length(full_dim)
        w.add_key_length_swa(HEAD_DIM)
        w.add_value_length_swa(HEAD_DIM)
        ff = cfg.intermediate_size
        w.add_feed_forward_length([ff if i < first_shared else 2 * ff for i in range(n)]
                                  if cfg.use_double_wide_mlp else ff)
        if global_kv := KINDS[kind].get("num_global_key_value_heads"):
            w.add_head_count_kv([kv if t == "sliding_attention" else global_kv for t in types])
        else:
            w.add_head_count_kv(kv)
        w.add_rope_dimension_count(full_dim)
        w.add_rope_dimension_count_swa(HEAD_DIM)
        rotated = int(full_dim * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
        extra["rope_freqs.weight"] = np.array([1.0] * rotated + [1e30] * (full_dim // 2 - rotated),
                                              np.float32)
    w.add_tokenizer_model("llama" if kind == "gemma3" else "gemma4")
    w.add_token_list(TOKENS)
    w.add_token_scores([-float(i) for i in range(len(TOKENS))])
    w.add_token_types(TYPES)
    if kind != "gemma3":
        w.add_token_merges([f"{a} {b}" for a, b in _merges()])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(arch, n)
    for name, value in {**model.state_dict(), **extra}.items():
        if name == "lm_head.weight":
            continue  # tied
        data = value if isinstance(value, np.ndarray) else value.numpy().astype(np.float32)
        if name in extra:
            w.add_tensor(name, data)
            continue
        if name.endswith("layer_scalar"):
            name += ".weight"  # as the converter's filter_tensors renames it
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if kind == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0  # Gemma3RMSNorm scales by 1 + w; llama.cpp stores 1 + w
        w.add_tensor(target, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["gemma3", "e2b", "31b"])
def test_gemma_gguf_serves_transformers_logits(tmp_path: Path, kind: str) -> None:
    model = _model(kind)
    write_gguf(model, tmp_path / "m.gguf", kind)
    _hf_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path / "m.gguf"), dtype="float32", progress=False)
    assert loaded.config["model_type"] == ("gemma3_text" if kind == "gemma3" else "gemma4_text")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = loaded.tokenizer.encode(TEXT)
    assert ids == hf_tok.encode(TEXT) and ids[0] == 2 and TOKENS.index("▁hello") in ids
    assert loaded.tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    ids = (ids * 3)[:30]  # past the sliding window of 8
    core = EngineCore(EngineConfig(kv_cache_memory="16MiB", max_model_len=128, block_size=4,
                                   show_progress=False), loaded)
    h = core.runner.forward_chunks([(ids, 0, list(range(8)), len(ids))])
    got = np.array(adapter.compute_logits(core.runner.model, h))
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    if kind == "e2b":  # the published E2B's structure came through the metadata
        cfg = loaded.config
        assert (cfg["num_kv_shared_layers"], cfg["use_double_wide_mlp"], cfg["hidden_size_per_layer_input"],
                cfg["global_head_dim"]) == (4, True, 8, 32)
        assert cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25
    if kind == "31b":
        assert loaded.config["attention_k_eq_v"] and loaded.config["num_global_key_value_heads"] == 2
        assert adapter.kv_layout(loaded.model).shapes[2] == (2, 32)


def test_moe_gguf_is_refused_by_name(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "gemma4")
    w.add_block_count(1)
    w.add_expert_count(4)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        load_model(str(tmp_path / "moe.gguf"), dtype="float32", progress=False)
