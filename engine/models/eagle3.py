"""EAGLE-3 draft heads as an MLX module: the `speculators` layout vLLM loads and the EAGLE authors' own.

One decoder layer over `[norm(embedding); norm(fused target features)]` with its own paged KV, a
draft-vocabulary head and `d2t` offsets to target ids (docs/speculative-decoding.md#eagle-3).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from engine.attention.types import AttentionMetadata
from engine.kv.cache import PagedKVCache
from engine.models.loader import LoadedModel, resolve_source
from engine.models.weights import load_arrays

SPECULATORS_TYPE = "eagle3"  # config.json's speculators_model_type
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
# EAGLE-3.1 options and multi-layer heads this module does not implement: refused at start-up.
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


class Eagle3Error(ValueError):
    pass


def _fail(msg: str) -> Eagle3Error:
    return Eagle3Error(f"invalid --speculative-config: model: {msg}")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    layout: str  # "speculators" (tensors under layers.0.) or "eagle" (under midlayer.)
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int | None
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the default for the target's depth
    norm_before_residual: bool

    @property
    def prefix(self) -> str:
        return "layers.0." if self.layout == "speculators" else "midlayer."

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a head must hold, with its shape (d2t only with a reduced vocabulary)."""
        h, p, inter = self.hidden_size, self.prefix, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "fc.weight": (h, 3 * self.target_hidden_size),
            f"{p}self_attn.q_proj.weight": (q, 2 * h), f"{p}self_attn.k_proj.weight": (kv, 2 * h),
            f"{p}self_attn.v_proj.weight": (kv, 2 * h), f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}mlp.gate_proj.weight": (inter, h), f"{p}mlp.up_proj.weight": (inter, h),
            f"{p}mlp.down_proj.weight": (h, inter),
            f"{p}input_layernorm.weight": (h,), f"{p}hidden_norm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,), "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
        }
        if self.draft_vocab_size != self.vocab_size:
            shapes["d2t"] = (self.draft_vocab_size,)
        return shapes


def is_eagle3(folder: Path) -> bool:
    cfg = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    return (cfg.get("speculators_model_type") == SPECULATORS_TYPE
            or EAGLE_ARCHITECTURE in cfg.get("architectures", []))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _fail(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise _fail(f"{path} is not a JSON object")
    return data


def read_config(folder: Path) -> Eagle3Config:
    """The head's shape from either layout's config.json; unknown variants are refused by name."""
    return parse_config(_read_json(folder / "config.json"), folder / "config.json")


def parse_config(raw: dict[str, Any], source: Path | str) -> Eagle3Config:
    """`read_config` for a config already read (`source` names it in errors)."""
    if raw.get("speculators_model_type") == SPECULATORS_TYPE:
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise _fail("speculators config without transformer_layer_config")
        layout, top = "speculators", raw
        # vLLM reads a missing norm_before_residual as True for speculators heads.
        norm_before_residual = bool(raw.get("norm_before_residual", True))
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
    elif EAGLE_ARCHITECTURE in raw.get("architectures", []):
        layout, top, layer = "eagle", raw, raw
        norm_before_residual = bool(raw.get("norm_before_residual", False))
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    else:
        raise _fail(f"{source} is not an EAGLE-3 head (no speculators_model_type 'eagle3' or "
                    f"architecture {EAGLE_ARCHITECTURE})")
    if flags := [f for f in _UNSUPPORTED_FLAGS if top.get(f)]:
        raise _fail(f"EAGLE-3 options {flags} are not supported")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise _fail("EAGLE-3 heads with more than one decoder layer are not supported")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise _fail("EAGLE-3 heads with biases are not supported")
    try:
        h, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        vocab = int(layer["vocab_size"])
        cfg = Eagle3Config(
            layout=layout, hidden_size=h, target_hidden_size=int(top.get("target_hidden_size") or h),
            num_heads=heads, num_kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or h // heads),
            intermediate_size=int(layer["intermediate_size"]),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(layer.get("rope_theta", 10000.0)), rope_scaling=layer.get("rope_scaling"),
            max_position_embeddings=layer.get("max_position_embeddings"), vocab_size=vocab,
            draft_vocab_size=int(top.get("draft_vocab_size") or vocab),
            aux_layer_ids=tuple(sorted(int(i) for i in aux)) if aux else None,
            norm_before_residual=norm_before_residual)
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(f"{source}: missing or invalid {e}") from None
    if cfg.aux_layer_ids is not None and len(cfg.aux_layer_ids) != 3:
        raise _fail(f"eagle_aux_hidden_state_layer_ids must name 3 layers, got {list(cfg.aux_layer_ids)}")
    return cfg


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's and the EAGLE authors' choice: a low, a middle and a high layer."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, embed: nn.Module) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.embed = embed
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rope = initialize_rope(hd, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings)
        self.scale = hd**-0.5
        self.d2t: mx.array | None = None  # draft id -> target id offset

    def fuse(self, aux: mx.array) -> mx.array:
        """[T, 3 * target hidden] target features -> [T, hidden]."""
        return self.fc(aux)

    def __call__(self, tokens: mx.array, hidden: mx.array, kv: PagedKVCache, meta: AttentionMetadata,
                 attention_fn: Callable[..., mx.array]) -> tuple[mx.array, mx.array]:
        """tokens [T], hidden [T, hidden] (fused features, or the previous step's output) at `meta`'s
        positions and slots of `kv` (layer 0) -> (draft-vocabulary logits [T, Vd], the layer's output
        [T, hidden], which the next draft step takes as its hidden)."""
        cfg, t = self.cfg, tokens.shape[0]
        e = self.input_layernorm(self.embed(tokens).astype(hidden.dtype))
        g = self.hidden_norm(hidden)
        x = mx.concatenate([e, g], axis=-1)  # [T, 2 * hidden]: the embedding first
        # [T, heads, 1, D]: each token its own row, so RoPE takes one position per token
        q = self.rope(self.q_proj(x).reshape(t, cfg.num_heads, 1, cfg.head_dim), offset=meta.positions)
        k = self.rope(self.k_proj(x).reshape(t, cfg.num_kv_heads, 1, cfg.head_dim), offset=meta.positions)
        v = self.v_proj(x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        kv.write(0, meta.slot_mapping, k.reshape(t, cfg.num_kv_heads, cfg.head_dim), v)
        kb, vb = kv.blocks(0)
        att = attention_fn(q.reshape(t, cfg.num_heads, cfg.head_dim), kb, vb, meta, self.scale, None)
        att = att.reshape(t, cfg.num_heads * cfg.head_dim)
        h1 = (g if cfg.norm_before_residual else hidden) + self.o_proj(att)
        y = self.post_attention_layernorm(h1)
        h2 = h1 + self.down_proj(nn.silu(self.gate_proj(y)) * self.up_proj(y))
        return self.lm_head(self.norm(h2)), h2

    def target_ids(self, draft_ids: mx.array) -> mx.array:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]


@dataclass(slots=True)
class LoadedEagle3:
    head: Eagle3Head
    config: Eagle3Config
    aux_layer_ids: tuple[int, ...]
    path: str
    dtype: mx.Dtype


def _weights(folder: Path) -> dict[str, mx.array]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(folder.glob("*.bin"))
        raise _fail(f"{folder} has no .safetensors weights" + (
            f" ({bins[0].name} is a PyTorch pickle: convert it to safetensors)" if bins else ""))
    out: dict[str, mx.array] = {}
    for f in files:
        out.update(load_arrays(str(f)))
    return out


def load_eagle3(source: str, target: LoadedModel, revision: str | None = None,
                aux_layer_ids: list[int] | None = None) -> LoadedEagle3:
    """The head at `source` (a folder or Hub id), checked against the target; every problem is an
    Eagle3Error naming the key or tensor. `aux_layer_ids` overrides the checkpoint's."""
    _, folder = resolve_source(source, revision)
    cfg = read_config(folder)
    t_args = target.config
    num_layers = int(t_args.get("num_hidden_layers") or len(target.model.model.layers))
    aux = tuple(sorted(aux_layer_ids)) if aux_layer_ids else None
    aux = aux or cfg.aux_layer_ids or default_aux_layers(num_layers)
    if not all(0 <= i < num_layers for i in aux):
        raise _fail(f"aux hidden-state layers {list(aux)} outside the target's {num_layers} layers")
    if cfg.target_hidden_size != int(t_args["hidden_size"]):
        raise _fail(f"the head reads target features of width {cfg.target_hidden_size}, the target's hidden "
                    f"size is {t_args['hidden_size']}")
    if cfg.vocab_size != target.vocab_size:
        raise _fail(f"the head's vocabulary ({cfg.vocab_size}) is not the target's ({target.vocab_size})")
    weights = _weights(folder)
    shapes = cfg.tensor_shapes()
    for name, shape in shapes.items():
        w = weights.get(name)
        if w is None:
            raise _fail(f"tensor {name} is missing from {folder}")
        if tuple(w.shape) != shape:
            raise _fail(f"tensor {name} has shape {tuple(w.shape)}, expected {shape}")
    embed: nn.Module = target.model.model.embed_tokens
    if "embed_tokens.weight" in weights:
        own = weights["embed_tokens.weight"]
        if tuple(own.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise _fail(f"tensor embed_tokens.weight has shape {tuple(own.shape)}, expected "
                        f"{(cfg.vocab_size, cfg.hidden_size)}")
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        embed.weight = own.astype(target.dtype)
    elif cfg.hidden_size != int(t_args["hidden_size"]):
        raise _fail("the head ships no embed_tokens and its width differs from the target's embeddings")
    head = Eagle3Head(cfg, embed)
    p = cfg.prefix
    renamed = {k.removeprefix(p).removeprefix("self_attn.").removeprefix("mlp."): w.astype(target.dtype)
               for k, w in weights.items() if k in shapes and k != "d2t"}
    head.load_weights(list(renamed.items()), strict=False)
    if "d2t" in shapes:
        d2t = weights["d2t"].astype(mx.int32)
        ids = mx.arange(cfg.draft_vocab_size, dtype=mx.int32) + d2t
        if int(mx.min(ids)) < 0 or int(mx.max(ids)) >= cfg.vocab_size:
            raise _fail("tensor d2t maps draft ids outside the target's vocabulary")
        head.d2t = d2t
    mx.eval(head.parameters())
    return LoadedEagle3(head, cfg, tuple(sorted(aux)), str(folder), target.dtype)
