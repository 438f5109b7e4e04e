"""Zero-head padding: heads the rank count does not divide are padded with zero heads before sharding (zero
rows and columns add nothing to the output), so every rank holds whole GQA groups."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def pad_heads(model: nn.Module, ranks: int) -> str | None:
    """Pad each llama-style attention layer's KV heads (and query groups) with zero heads up to a multiple of
    `ranks` -> a log line, or None when nothing needed it. ValueError for other layers that need it."""
    desc = None
    for layer in model.model.layers:
        attn = layer.self_attn
        n_kv = getattr(attn, "n_kv_heads", None)
        n_q = getattr(attn, "n_heads", None)
        if n_kv is None or n_q is None:
            raise ValueError("tensor parallel: the attention layers do not name their head counts")
        if n_kv % ranks == 0:
            continue
        q, k, v, o = (getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        if q is None or k is None or v is None or o is None:
            raise ValueError(f"tensor parallel: {n_kv} KV heads do not split over {ranks} ranks, and this "
                             "attention is not llama-shaped (q/k/v/o projections) for zero-head padding")
        group = n_q // n_kv
        head_dim = _out_dims(q) // n_q
        extra = -n_kv % ranks
        attn.q_proj = _pad_out(q, extra * group * head_dim)
        attn.k_proj = _pad_out(k, extra * head_dim)
        attn.v_proj = _pad_out(v, extra * head_dim)
        attn.o_proj = _pad_in(o, extra * group * head_dim)
        desc = f"{n_kv} KV / {n_q} query heads -> {n_kv + extra} / {n_q + extra * group}"
        attn.n_kv_heads, attn.n_heads = n_kv + extra, n_q + extra * group
    return desc


def _out_dims(m: nn.Module) -> int:
    return int(m.weight.shape[0])


def _zeros_like_rows(a: mx.array, rows: int) -> mx.array:
    return mx.zeros((rows, *a.shape[1:]), dtype=a.dtype)


def _pad_out(m: nn.Module, rows: int) -> nn.Module:
    """`m` with `rows` zero output features appended (its bias too)."""
    for name in ("weight", "scales", "biases", "bias"):
        if name in m:
            setattr(m, name, mx.concatenate([m[name], _zeros_like_rows(m[name], rows)], axis=0))
    return m


def _pad_in(m: nn.Module, cols: int) -> nn.Module:
    """`m` with `cols` zero input features appended (per-group arrays too)."""
    if isinstance(m, nn.QuantizedLinear):
        if cols % m.group_size or (cols * m.bits) % 32:
            raise ValueError(f"tensor parallel: {cols} padded input features do not fill whole quantization "
                             f"groups of {m.group_size}")
        groups = cols // m.group_size
        widths = {"weight": cols * m.bits // 32, "scales": groups, "biases": groups}
    elif isinstance(m, nn.Linear):
        widths = {"weight": cols}
    else:
        raise ValueError(f"tensor parallel: cannot pad a {type(m).__name__} output projection")
    for name, width in widths.items():
        if name in m:
            a = m[name]
            setattr(m, name, mx.concatenate([a, mx.zeros((a.shape[0], width), dtype=a.dtype)], axis=1))
    return m
