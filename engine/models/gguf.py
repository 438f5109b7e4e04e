"""Convert a llama, qwen2, qwen3, gemma3 or gemma4 GGUF file into an mlx-lm / Hugging Face style folder:
tensors renamed, llama.cpp's Q/K permutation and gemma3's norm +1 undone, config and tokenizer rebuilt from
the metadata (what is supported: docs/http-api.md)."""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from tqdm import tqdm

from engine.cpu.host import float_list
from engine.models.gguf_file import (
    BLOCK_TYPES,
    GGML_GROUP_SIZE,
    dense,
    model_dtype,
    py_value,
    read_file,
    tensor_arrays,
)
from engine.models.gguf_tokenizer import build_tokenizer, stop_ids

# Written last into a converted folder; a folder without it is not a finished conversion.
MARKER_NAME = ".gguf-conversion-complete"
# Bumped when the output changes.
_FORMAT_VERSION = 2

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's names where they differ from llama's.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
_GEMMA_TOP_NAMES = {
    **_TOP_NAMES,
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
# Every layer has these (Gemma4's KV-shared layers have no K/V projections).
_REQUIRED_BLOCK = ("attn_norm", "attn_q", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class _Arch:
    hf_class: str
    model_type: str  # mlx-lm's
    permuted_qk: bool  # llama.cpp permuted Q/K rows (llama's RoPE layout)
    layer_names: dict[str, str]
    top_names: dict[str, str]
    norm_shift: float = 0.0  # llama.cpp stored norm weight + this (Gemma3 scales by 1 + w)


_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", True, _LAYER_NAMES, _TOP_NAMES),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", False, _LAYER_NAMES, _TOP_NAMES),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", False, _LAYER_NAMES, _TOP_NAMES),
    "gemma3": _Arch("Gemma3ForCausalLM", "gemma3_text", False, _GEMMA_LAYER_NAMES, _GEMMA_TOP_NAMES, 1.0),
    "gemma4": _Arch("Gemma4ForCausalLM", "gemma4_text", False, _GEMMA_LAYER_NAMES, _GEMMA_TOP_NAMES),
}

_DTYPE_NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}


@dataclass
class GGUFModel:
    config: dict[str, Any]
    weights: dict[str, mx.array]
    tokenizer_json: dict[str, Any]
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]
    special_tokens_map: dict[str, str] = field(default_factory=dict)


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's Q/K permutation `reshape(n_head, 2, r, ...).swapaxes(1, 2)`; it moves whole output
    rows, so it commutes with quantization (packed along the input dim)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of rotary pairs")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(value: float) -> float:
    # Shortest decimal that round-trips the float32 value (1e-05, not 9.99999974e-06).
    return float(str(np.float32(value)))


def _hf_name(name: str, arch: _Arch | None = None) -> str:
    arch = arch or _ARCHS["llama"]
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) >= 4 and parts[2] == "layer_output_scale":
        return f"model.layers.{parts[1]}.layer_scalar"  # gemma4's [1] parameter, not a module's weight
    if parts[0] == "blk" and len(parts) >= 4 and parts[2] in arch.layer_names:
        return f"model.layers.{parts[1]}.{arch.layer_names[parts[2]]}.{'.'.join(parts[3:])}"
    if parts[0] in arch.top_names and len(parts) >= 2:
        return f"{arch.top_names[parts[0]]}.{'.'.join(parts[1:])}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face equivalent here")


def _quant_params(weights: dict[str, mx.array], module: str) -> dict[str, int]:
    packed, scales = weights[f"{module}.weight"], weights[f"{module}.scales"]
    in_dims = scales.shape[-1] * GGML_GROUP_SIZE
    bits, rem = divmod(packed.shape[-1] * 32, in_dims)
    if rem or bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"{module}: cannot infer bits from {packed.shape} packed / {scales.shape} scales")
    return {"group_size": GGML_GROUP_SIZE, "bits": bits}


def _quantization_config(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """mlx-lm's format: a default plus per-module entries where a module differs from it."""
    params = {n[: -len(".scales")]: _quant_params(weights, n[: -len(".scales")])
              for n in weights if n.endswith(".scales")}
    if not params:
        return None
    counts = Counter((p["group_size"], p["bits"]) for p in params.values())
    group_size, bits = counts.most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": group_size, "bits": bits}
    for module, p in sorted(params.items()):
        if (p["group_size"], p["bits"]) != (group_size, bits):
            config[module] = p
    return config


def _llama3_rope_scaling(factors: list[float], theta: float, head_dim: int, md: dict,
                         arch: str = "llama") -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from the rope_freqs tensor llama.cpp derived from it."""
    factor = max(factors)
    orig = int(py_value(md.get(gguf.Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch), 8192)))
    for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
        expected = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * theta ** (i / head_dim)
            if wavelen < orig / high:
                expected.append(1.0)
            elif wavelen > orig / low:
                expected.append(factor)
            else:
                smooth = (orig / wavelen - low) / (high - low)
                expected.append(1 / ((1 - smooth) / factor + smooth))
        if np.allclose(expected, factors, rtol=1e-3):
            return {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise NotImplementedError("rope_freqs.weight does not match any llama3 rope scaling this converter knows")


class _Meta:
    """The architecture's metadata keys (`{arch}.{key}`)."""

    def __init__(self, md: dict[str, Any], arch: str) -> None:
        self.md, self.arch = md, arch

    def get(self, key: str, default: Any = None) -> Any:
        value = py_value(self.md.get(f"{self.arch}.{key}", default))
        if value is None:
            raise ValueError(f"GGUF metadata lacks {self.arch}.{key}")
        return value

    def scalar(self, key: str, default: Any = None) -> Any:
        value = self.get(key, default)
        # Some GGUFs store per-layer lists; where a family needs them uniform, say so.
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise NotImplementedError(f"{self.arch}.{key} varies per layer: {value}")
            value = value[0]
        return value

    def per_layer(self, key: str, n: int, default: Any = None) -> list[Any]:
        value = self.get(key, default)
        return list(value) if isinstance(value, list) else [value] * n


def _build_config(md: dict[str, Any], weights: dict[str, mx.array], rope_freqs: mx.array | None,
                  arch: str = "llama") -> dict:
    meta = _Meta(md, arch)
    get, scalar = meta.get, meta.scalar
    if arch.startswith("gemma"):
        return _gemma_config(meta, weights, rope_freqs)
    hidden, n_head = int(get("embedding_length")), int(scalar("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_head))
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise NotImplementedError(f"partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    theta = _f32(get("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [_ARCHS[arch].hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(scalar("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(scalar("attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in weights,
        "hidden_act": "silu",
    }
    scaling = py_value(md.get(gguf.Keys.Rope.SCALING_TYPE.format(arch=arch)))
    if rope_freqs is not None:
        config["rope_scaling"] = _llama3_rope_scaling(float_list(rope_freqs), theta, head_dim, md, arch)
    elif scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": _f32(get("rope.scaling.factor"))}
        if scaling == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length"))
    elif scaling not in (None, "none"):
        raise NotImplementedError(f"rope scaling {scaling!r} is not supported")
    return config


def _gemma_config(meta: _Meta, weights: dict[str, mx.array], rope_freqs: mx.array | None) -> dict:
    """gemma3 / gemma4 metadata as mlx-lm's config, with what llama.cpp assumes where the file is silent
    (gemma3: every sixth layer global, attention scaled by the head size, GELU-tanh MLPs)."""
    get = meta.get
    n = int(get("block_count"))
    hidden, n_head = int(get("embedding_length")), int(meta.scalar("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [_ARCHS[meta.arch].hf_class],
        "model_type": _ARCHS[meta.arch].model_type,
        "hidden_size": hidden,
        "num_hidden_layers": n,
        "num_attention_heads": n_head,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length", 131072)),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(get("attention.sliding_window")),
    }
    if (cap := py_value(meta.md.get(f"{meta.arch}.final_logit_softcapping"))) is not None:
        config["final_logit_softcapping"] = _f32(cap)
    theta, theta_swa = _f32(get("rope.freq_base", 1_000_000.0)), _f32(get("rope.freq_base_swa", 10_000.0))
    if meta.arch == "gemma3":
        _gemma3_config(meta, config, theta, theta_swa)
    else:
        _gemma4_config(meta, config, weights, rope_freqs, theta, theta_swa)
    return config


def _gemma3_config(meta: _Meta, config: dict[str, Any], theta: float, theta_swa: float) -> None:
    get, n_head, hidden = meta.get, config["num_attention_heads"], config["hidden_size"]
    head_dim = int(get("attention.key_length"))
    config.update(
        intermediate_size=int(meta.scalar("feed_forward_length")),
        num_key_value_heads=int(meta.scalar("attention.head_count_kv", n_head)), head_dim=head_dim,
        query_pre_attn_scalar=hidden // n_head if config["num_hidden_layers"] == 62 else head_dim,
        sliding_window_pattern=6, rope_theta=theta, rope_local_base_freq=theta_swa)
    scaling = py_value(meta.md.get(gguf.Keys.Rope.SCALING_TYPE.format(arch=meta.arch)))
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise NotImplementedError(f"rope scaling {scaling!r} is not supported for gemma3")


def _gemma4_config(meta: _Meta, config: dict[str, Any], weights: dict[str, mx.array],
                   rope_freqs: mx.array | None, theta: float, theta_swa: float) -> None:
    """gemma4's per-layer attention type, head size, KV heads and MLP width."""
    get, n = meta.get, config["num_hidden_layers"]
    sliding = [bool(x) for x in meta.per_layer("attention.sliding_window_pattern", n)]
    shared = int(get("attention.shared_kv_layers", 0))
    first_shared = n - shared
    kv = [int(x) for x in meta.per_layer("attention.head_count_kv", n, config["num_attention_heads"])]
    ffn = [int(x) for x in meta.per_layer("feed_forward_length", n)]
    head_dim, global_head_dim = int(get("attention.key_length_swa")), int(get("attention.key_length"))
    kv_swa = {k for k, s in zip(kv, sliding, strict=True) if s} or set(kv)
    kv_full = {k for k, s in zip(kv, sliding, strict=True) if not s} or kv_swa
    widths = set(ffn[:first_shared])
    if len(kv_swa) != 1 or len(kv_full) != 1 or len(widths) != 1:
        raise NotImplementedError(f"gemma4: KV heads {kv} or MLP widths {ffn} vary within a layer type")
    width = widths.pop()
    double = shared > 0 and all(f == 2 * width for f in ffn[first_shared:])
    if not double and any(f != width for f in ffn):
        raise NotImplementedError(f"gemma4: MLP widths {ffn} are neither uniform nor double on shared layers")
    # K = V: the full-attention layers that store KV have no V projection.
    full_stores = [i for i in range(first_shared) if not sliding[i]]
    k_eq_v = bool(full_stores) and all(f"model.layers.{i}.self_attn.v_proj.weight" not in weights
                                       for i in full_stores)
    # rope_freqs (full layers only): 1 for the rotated pairs, 1e30 for the pairs left as they are.
    factor = 1.0
    if rope_freqs is not None:
        freqs = np.array(rope_freqs.astype(mx.float32))
        factor = float((freqs < 1e20).sum() * 2 / global_head_dim)
    if (rot_swa := int(get("rope.dimension_count_swa", head_dim))) != head_dim:
        raise NotImplementedError(f"gemma4: partial rotary on sliding layers ({rot_swa} of {head_dim} dims)")
    per_layer = int(get("embedding_length_per_layer_input", 0))
    config.update(
        intermediate_size=width, use_double_wide_mlp=double, num_kv_shared_layers=shared,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        num_key_value_heads=kv_swa.pop(), head_dim=head_dim, global_head_dim=global_head_dim,
        attention_k_eq_v=k_eq_v, hidden_size_per_layer_input=per_layer,
        rope_parameters={
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": factor,
                               "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": theta_swa}})
    full_kv = kv_full.pop()
    if k_eq_v or full_kv != config["num_key_value_heads"]:
        config["num_global_key_value_heads"] = full_kv
    if per_layer:
        config["vocab_size_per_layer_input"] = int(weights["model.embed_tokens_per_layer.weight"].shape[0])


def _check_tensors(tensors: dict[str, Any], arch: str, n_layers: int) -> None:
    """Refuse a file without the block tensors every layer of these families has."""
    bases = {n.rsplit(".", 1)[0] for n in tensors}
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    block = [gguf.TENSOR_NAMES[t].split(".")[-1] for t in gguf.MODEL_TENSORS[arch_enum]
             if gguf.TENSOR_NAMES[t].startswith("blk.")]
    required = [b for b in block if b in _REQUIRED_BLOCK]
    expected = {"token_embd", "output_norm"} | {f"blk.{i}.{b}" for i in range(n_layers) for b in required}
    if missing := sorted(expected - bases):
        raise ValueError(f"GGUF lacks tensors {missing[:5]}")


def read_gguf(path: str | Path, progress: bool = False, *, dtype: mx.Dtype | None = None) -> GGUFModel:
    """Read a GGUF into HF/mlx-lm named weights plus config and tokenizer files. `dtype` casts every float
    tensor, quantization scales included (None: by `model_dtype`)."""
    md, tensors = read_file(Path(path))
    arch = py_value(md.get(gguf.Keys.General.ARCHITECTURE))
    if arch not in _ARCHS:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (only {', '.join(_ARCHS)})")
    family = _ARCHS[arch]
    if py_value(md.get(f"{arch}.expert_count")):
        raise NotImplementedError(f"GGUF {arch}: mixture-of-experts files are not supported")
    n_layers = int(py_value(md[gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)]))
    n_head = py_value(md[gguf.Keys.Attention.HEAD_COUNT.format(arch=arch)])
    n_kv = py_value(md.get(gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=arch), n_head))
    heads = {"attn_q": n_head, "attn_k": n_kv} if family.permuted_qk else {}
    heads = {k: int(v[0] if isinstance(v, list) else v) for k, v in heads.items()}

    _check_tensors(tensors, arch, n_layers)
    rope_freqs = dense(tensors.pop("rope_freqs.weight")) if "rope_freqs.weight" in tensors else None
    if dtype is None:
        dtype = model_dtype({t.qtype for t in tensors.values()})
    arrays: dict[str, mx.array] = {}
    blocks: dict[str, str] = {}  # GGUF tensor name -> GGML type, for matrices kept as their blocks
    for tensor_name in tqdm(sorted(tensors), desc="gguf -> mlx", unit="tensor", disable=not progress):
        t = tensors.pop(tensor_name)
        for name, w in tensor_arrays(t).items():
            if w.dtype == mx.uint8 and t.qtype in BLOCK_TYPES:
                blocks[name] = t.qtype.name
            parts = name.split(".")
            if parts[0] == "blk" and parts[2] in heads:
                w = unpermute_rows(w, heads[parts[2]])
            if family.norm_shift and name.endswith("norm.weight"):
                w = w.astype(mx.float32) - family.norm_shift
            if mx.issubdtype(w.dtype, mx.floating):
                w = w.astype(dtype)
            mx.eval(w)
            arrays[name] = w
    # In GGUF name order, as mx.load's were: a folder converted again is byte-identical.
    weights = {_hf_name(name, family): arrays.pop(name) for name in sorted(arrays)}

    config = _build_config(md, weights, rope_freqs, arch)
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    if (quant := _quantization_config(weights)) is not None:
        config["quantization"] = quant
    if blocks:  # module path -> type (weights.BlockLinear)
        config["gguf_blocks"] = {_hf_name(n, family).removesuffix(".weight"): q
                                 for n, q in sorted(blocks.items())}
    tokenizer_json, tokenizer_config, special_map = build_tokenizer(md, config["max_position_embeddings"])
    stops = stop_ids(md)
    bos_id = py_value(md.get("tokenizer.ggml.bos_token_id"))
    config["bos_token_id"] = None if bos_id is None else int(bos_id)
    config["eos_token_id"] = stops[0] if len(stops) == 1 else (stops or None)
    generation_config = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if (pad_id := py_value(md.get("tokenizer.ggml.padding_token_id"))) is not None:
        generation_config["pad_token_id"] = int(pad_id)
    return GGUFModel(config, weights, tokenizer_json, tokenizer_config, generation_config, special_map)


def is_converted(out_dir: str | Path) -> bool:
    """True when `out_dir` holds a finished conversion (the marker is written last)."""
    return (Path(out_dir) / MARKER_NAME).is_file()


def is_current(out_dir: str | Path) -> bool:
    """True when `out_dir` holds a finished conversion written by this converter's format version."""
    try:
        marker = json.loads((Path(out_dir) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == _FORMAT_VERSION


def _write_folder(model: GGUFModel, folder: Path, source: Path) -> None:
    def dump(name: str, obj: Any) -> None:
        (folder / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    dump("config.json", model.config)
    mx.save_safetensors(str(folder / "model.safetensors"), model.weights, metadata={"format": "mlx"})
    dump("tokenizer.json", model.tokenizer_json)
    dump("tokenizer_config.json", model.tokenizer_config)
    dump("special_tokens_map.json", model.special_tokens_map)
    dump("generation_config.json", model.generation_config)
    stat = source.stat()
    dump(MARKER_NAME, {"format_version": _FORMAT_VERSION, "source": str(source),
                       "source_size": stat.st_size, "source_mtime": stat.st_mtime})


def convert_gguf(
    path: str | Path, out_dir: str | Path, progress: bool = True, *, dtype: mx.Dtype | None = None
) -> Path:
    """Convert a GGUF file into an MLX model folder at `out_dir` (built under a temporary name, then renamed
    into place); an existing finished conversion is replaced, any other non-empty `out_dir` refused."""
    source, out = Path(path).resolve(), Path(out_dir).resolve()
    if out.exists() and not is_converted(out):
        if any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not a finished GGUF conversion")
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_folder(read_gguf(source, progress=progress, dtype=dtype), tmp, source)
        if out.exists():
            # A folder cannot be os.replace()d over a non-empty one: move the old one aside first.
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
