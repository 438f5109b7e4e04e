"""Configs as transformers writes them in the form mlx-lm reads: transformers 5.x folds a Gemma4 text config's
full-attention head size and KV heads into `per_layer_config`, mlx-lm reads flat keys."""

from __future__ import annotations

from typing import Any

_GEMMA4_TYPES = ("gemma4", "gemma4_text", "gemma4_assistant", "gemma4_mtp")
_FULL = "full_attention"


def gemma4_text_args(text: dict[str, Any]) -> dict[str, Any]:
    """`text` (a gemma4 text config) with `per_layer_config` as mlx-lm's flat keys; ValueError for overrides
    mlx-lm cannot express."""
    if "per_layer_config" not in text:
        return text
    per_layer = text["per_layer_config"] or {}  # empty when no layer differs
    out = {k: v for k, v in text.items() if k != "per_layer_config"}
    types = list(text.get("layer_types") or [])
    head_dim, kv_heads = text.get("head_dim"), text.get("num_key_value_heads")
    # Keys are layer indices as strings, zero-padded to the widest ("05" of 12 layers).
    by_layer = {int(k): dict(v or {}) for k, v in per_layer.items()}
    if any(i < 0 or i >= len(types) for i in by_layer):
        raise ValueError(f"per_layer_config names layers {sorted(by_layer)} outside 0..{len(types) - 1}")
    fulls: set[tuple[Any, Any]] = set()
    for i, kind in enumerate(types):
        over = by_layer.get(i, {})
        extra = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if extra:
            raise ValueError(f"per_layer_config overrides {extra} for layer {i}: only the full-attention "
                             f"layers' head_dim and num_key_value_heads can be served")
        shape = (over.get("head_dim", head_dim), over.get("num_key_value_heads", kv_heads))
        if kind != _FULL:
            if shape != (head_dim, kv_heads):
                raise ValueError(f"per_layer_config overrides sliding layer {i}: only full-attention layers "
                                 f"may differ")
            continue
        fulls.add(shape)
    if len(fulls) > 1:
        raise ValueError(f"per_layer_config gives full-attention layers different shapes {sorted(fulls)}")
    if not fulls:
        return out
    ((global_dim, global_kv),) = fulls
    out.setdefault("global_head_dim", global_dim)
    if global_kv != kv_heads:
        if not text.get("attention_k_eq_v"):
            # mlx-lm gives full layers their own KV head count only together with K = V.
            raise ValueError(f"per_layer_config gives full-attention layers {global_kv} KV heads (others "
                             f"{kv_heads}) without attention_k_eq_v")
        out.setdefault("num_global_key_value_heads", global_kv)
    return out


def mlx_config(config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config.json as mlx-lm should read it (unchanged for families that need nothing)."""
    if config.get("model_type") not in _GEMMA4_TYPES:
        return config
    out = gemma4_text_args(config)
    if isinstance(config.get("text_config"), dict):
        out = dict(out, text_config=gemma4_text_args(config["text_config"]))
    return out
