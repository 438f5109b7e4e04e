"""A trained MTP assistant for llama-family targets (`model_type: specserve_mtp`, from `specserve
train-assistant`): one query-only decoder layer and a head over a reduced vocabulary (docs/mtp.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models.weights import flat_arrays, load_arrays

TRAINED_TYPE = "specserve_mtp"


class QueryOnlyAttention(nn.Module):
    def __init__(self, hidden: int, n_heads: int, head_dim: int, rope_theta: float,
                 traditional: bool) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)
        self.rope = nn.RoPE(head_dim, traditional=traditional, base=rope_theta)
        self.scale = head_dim**-0.5

    def paged(self, x: mx.array, positions: mx.array | int, cache: Any) -> mx.array:
        # x: [N, 1, hidden], one query per request; keys/values come from the target's paged KV.
        n = x.shape[0]
        q = self.q_proj(x).reshape(n, 1, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        # nn.RoPE annotates offset as int; mx.fast.rope takes arrays.
        q = self.rope(q, offset=positions)  # type: ignore[arg-type]
        o = cache.attention(q, self.scale)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(n, 1, -1))

    def dense(self, x: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        """Training layout: x [B, T, hidden] for query positions 1..T, keys/values [B, Hkv, T, D] of positions
        0..T-1; query t sees keys 0..t-1 only."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=1)
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask="causal")
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TrainedAssistant(nn.Module):
    """Weights: projections, one query-only decoder layer, final norm, reduced-vocabulary head."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        d, backbone = int(config["hidden_size"]), int(config["backbone_hidden_size"])
        self.pre_projection = nn.Linear(2 * backbone, d, bias=False)
        self.input_layernorm = nn.RMSNorm(d, eps=float(config["rms_norm_eps"]))
        self.self_attn = QueryOnlyAttention(d, int(config["num_attention_heads"]), int(config["head_dim"]),
                                            float(config["rope_theta"]), bool(config.get("rope_traditional")))
        self.post_attention_layernorm = nn.RMSNorm(d, eps=float(config["rms_norm_eps"]))
        self.mlp = MLP(d, int(config["intermediate_size"]))
        self.norm = nn.RMSNorm(d, eps=float(config["rms_norm_eps"]))
        self.head = nn.Linear(d, int(config["head_size"]), bias=False)
        self.post_projection = nn.Linear(d, backbone, bias=False)
        self.vocab_ids = mx.zeros((int(config["head_size"]),), dtype=mx.int32)  # head row -> token id
        self.freeze(keys=["vocab_ids"], recurse=False)

    def _block(self, h: mx.array, attend: Any) -> mx.array:
        h = h + attend(self.input_layernorm(h))
        h = h + self.mlp(self.post_attention_layernorm(h))
        return self.norm(h)

    def __call__(self, x: mx.array, positions: mx.array | int,
                 caches: list[Any]) -> tuple[mx.array, mx.array]:
        """x: [N, 2 * backbone] = [target embedding, target hidden] -> (logits over the head's rows [N,
        head_size], row i scoring `vocab_ids[i]`; next hidden [N, backbone]). Never scattered to the full
        vocabulary: the argmax and its probability are the same, and the scatter cost a large share."""
        h = self.pre_projection(x)[:, None, :]  # [N, 1, d]
        out = self._block(h, lambda y: self.self_attn.paged(y, positions, caches[0]))[:, 0, :]
        return self.head(out), self.post_projection(out)

    def train_logits(self, x: mx.array, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """x: [B, T, 2 * backbone] -> (head logits [B, T, head_size], next hidden [B, T, backbone])."""
        out = self._block(self.pre_projection(x), lambda y: self.self_attn.dense(y, keys, values))
        return self.head(out), self.post_projection(out)


def save_trained(net: TrainedAssistant, folder: Path, dtype: mx.Dtype = mx.float16) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: (v if k == "vocab_ids" else v.astype(dtype)) for k, v in flat_arrays(net.parameters())}
    weights["vocab_ids"] = net.vocab_ids
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(net.config, indent=1) + "\n")


# The config fields behind each tensor's shape, for the message when a checkpoint disagrees.
_SHAPE_FIELDS = {
    "pre_projection.weight": "hidden_size, 2 x backbone_hidden_size",
    "post_projection.weight": "backbone_hidden_size, hidden_size",
    "self_attn.q_proj.weight": "num_attention_heads x head_dim, hidden_size",
    "self_attn.o_proj.weight": "hidden_size, num_attention_heads x head_dim",
    "mlp.gate_proj.weight": "intermediate_size, hidden_size",
    "mlp.up_proj.weight": "intermediate_size, hidden_size",
    "mlp.down_proj.weight": "hidden_size, intermediate_size",
    "head.weight": "head_size, hidden_size",
    "vocab_ids": "head_size",
}
_INT_FIELDS = ("vocab_size", "backbone_hidden_size", "hidden_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "head_size")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


def check_config(config: dict) -> None:
    """Every size field present, a positive integer, and consistent; raises ValueError naming the field."""
    for key in (*_INT_FIELDS, *_FLOAT_FIELDS):
        if key not in config:
            raise ValueError(f"config.json lacks {key!r}")
        v = config[key]
        kind = "integer" if key in _INT_FIELDS else "number"
        number = isinstance(v, int | float) and not isinstance(v, bool)
        if not number or not v > 0 or (kind == "integer" and v != int(v)):
            raise ValueError(f"config.json {key}: {v!r} is not a positive {kind}")
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if int(config["head_dim"]) % 2:
        raise ValueError(f"head_dim {config['head_dim']} is odd (RoPE rotates halves)")
    if int(config["head_size"]) > int(config["vocab_size"]):
        raise ValueError(f"head_size {config['head_size']} is larger than vocab_size {config['vocab_size']}")


def id_out_of_range(ids: mx.array, size: int) -> int | None:
    """An id of `ids` outside [0, size), or None (C code indexes tables of `size` rows with them)."""
    if not ids.size:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    return lo if lo < 0 else hi if hi >= size else None


def check_weights(net: TrainedAssistant, weights: dict[str, mx.array], source: str) -> None:
    """The checkpoint holds exactly the tensors the config implies, with their shapes and float dtypes;
    raises ValueError naming the tensor."""
    want = dict(flat_arrays(net.parameters()))
    missing = sorted(want.keys() - weights.keys())
    if missing:
        raise ValueError(f"{source} lacks weight(s) {missing}")
    extra = sorted(weights.keys() - want.keys())
    if extra:
        raise ValueError(f"{source} has weight(s) {extra} that a {TRAINED_TYPE} assistant does not have")
    for k, w in want.items():
        got = weights[k]
        if got.shape != w.shape:
            why = f" ({_SHAPE_FIELDS[k]})" if k in _SHAPE_FIELDS else ""
            raise ValueError(f"weight {k}: shape {tuple(got.shape)} in {source}, config.json implies "
                             f"{tuple(w.shape)}{why}")
        integer = mx.issubdtype(got.dtype, mx.integer)
        if (k == "vocab_ids") != integer or not (integer or mx.issubdtype(got.dtype, mx.floating)):
            kind = "integer" if k == "vocab_ids" else "floating-point"
            raise ValueError(f"weight {k}: dtype {got.dtype} in {source}, not {kind}")
    vocab = int(net.config["vocab_size"])
    bad = id_out_of_range(weights["vocab_ids"], vocab)
    if bad is not None:
        raise ValueError(f"vocab_ids: token id {bad} in {source} is outside the vocabulary [0, {vocab}) "
                         f"(vocab_size {vocab})")


def load_trained(folder: Path, config: dict, dtype: mx.Dtype) -> TrainedAssistant:
    """Build the assistant `config` describes and load its checkpoint strictly; ValueError names what
    disagrees."""
    check_config(config)
    net = TrainedAssistant(config)
    file = folder / "model.safetensors"
    if not file.is_file():
        raise ValueError(f"no model.safetensors in {folder}")
    weights = load_arrays(str(file))
    check_weights(net, weights, file.name)
    net.load_weights([(k, v.astype(mx.int32 if k == "vocab_ids" else dtype)) for k, v in weights.items()])
    mx.eval(net.parameters())
    return net
