"""Run mlx-lm model classes unchanged over the paged KV cache.

The whole step is one flat batch of T tokens laid out as `[T, 1, hidden]`: every linear layer sees
the same matmul as `[1, T, hidden]`, while RoPE gets a per-token `offset` array of shape [T] (MLX's
rope takes one offset per batch row). A step with a single request (single-stream decode, draft
verification, one prefill chunk) uses the model's usual `[1, T, hidden]` layout with an integer
offset instead, which is cheaper for RoPE and attention. Each layer's `cache` is a `PagedLayerCache`: mlx-lm's
attention calls `rope(x, offset=cache.offset)`, `cache.update_and_fetch(k, v)` (we write the new
rows into their slots) and the model module's `scaled_dot_product_attention(..., cache=cache)`,
which we route to paged attention. No model code is forked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.attention.reference import LOG2E, paged_attention_reference
from engine.attention.types import AttentionMetadata
from engine.kv.cache import PagedKVCache

_PATCHED_ATTR = "_specserve_paged"


class PagedLayerCache:
    def __init__(self, kv: PagedKVCache, layer: int, window: int | None) -> None:
        self.kv = kv
        self.layer = layer
        self.window = window
        self.meta: AttentionMetadata | None = None
        self.attention_fn: Callable[..., mx.array] = paged_attention_reference

    @property
    def offset(self) -> mx.array | int:
        assert self.meta is not None
        if self.meta.single_request:
            return self.meta.start_pos
        return self.meta.positions  # [T]: each token is its own "batch row"

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys/values: [T, Hkv, 1, D], or [1, Hkv, T, D] for a single request
        assert self.meta is not None
        if self.meta.single_request:
            k, v = keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2)
        else:
            t, hkv, _, d = keys.shape
            k, v = keys.reshape(t, hkv, d), values.reshape(t, hkv, d)
        self.kv.write(self.layer, self.meta.slot_mapping, k, v)
        return keys, values

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # masks are built from the metadata inside paged attention

    def attention(self, queries: mx.array, scale: float) -> mx.array:
        # queries: [T, H, 1, D] -> [T, H, 1, D] (single request: [1, H, T, D] -> [1, H, T, D])
        assert self.meta is not None
        kb, vb = self.kv.blocks(self.layer)
        if self.meta.single_request:
            q = queries[0].transpose(1, 0, 2)  # [T, H, D]
            return self.attention_fn(q, kb, vb, self.meta, scale, self.window).transpose(1, 0, 2)[None]
        t, h, _, d = queries.shape
        out = self.attention_fn(queries.reshape(t, h, d), kb, vb, self.meta, scale, self.window)
        return out.reshape(t, h, 1, d)


def _dispatching_sdpa(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):  # noqa: ANN001, ANN202
        if isinstance(cache, PagedLayerCache):
            if sinks is not None:
                raise NotImplementedError("attention sinks are not supported on the paged cache")
            return cache.attention(queries, scale)
        if sinks is None:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(sdpa, _PATCHED_ATTR, True)
    return sdpa


@partial(mx.compile, shapeless=True)
def swiglu_pow2(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x with the exponential taken as a power of two: MLX's CPU `sigmoid` costs several
    times this per element, and every verified draft adds a row of SiLU to the step (figures:
    docs/design-notes.md). Agrees with mlx-lm's to ~5e-7 relative."""
    return gate * x / (1.0 + mx.power(2.0, gate * -LOG2E))


def install(model: nn.Module) -> None:
    """Route the model module's attention through `PagedLayerCache` when one is passed, and on the
    CPU its SwiGLU through `swiglu_pow2`. Both are the model module's own globals, so mlx-lm's code
    (and anything else running the module in this process) sees the same functions."""
    mod = sys.modules[type(model).__module__]
    fn = getattr(mod, "scaled_dot_product_attention", None)
    if fn is None:
        raise ValueError(
            f"model module {mod.__name__} does not call mlx-lm's scaled_dot_product_attention; "
            "its architecture is not supported on the paged cache")
    if not getattr(fn, _PATCHED_ATTR, False):
        mod.scaled_dot_product_attention = _dispatching_sdpa(fn)
    from mlx_lm.models.activations import swiglu

    if getattr(mod, "swiglu", None) is swiglu and mx.default_device() == mx.cpu:
        mod.swiglu = swiglu_pow2


def layer_windows(model: nn.Module) -> list[int | None]:
    """Sliding-window size per layer, read from the caches mlx-lm would build for the model."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    n = len(model.layers)
    if not hasattr(model, "make_cache"):
        return [None] * n
    out: list[int | None] = []
    for i, c in enumerate(model.make_cache()):
        if isinstance(c, RotatingKVCache):
            out.append(c.max_size)
        elif isinstance(c, KVCache):
            out.append(None)
        else:
            raise ValueError(f"layer {i} uses {type(c).__name__}: not an attention KV cache; "
                             "this architecture is not supported")
    return out


def kv_shape(model: nn.Module) -> tuple[int, int]:
    """(num_kv_heads, head_dim), uniform across layers."""
    attn = model.layers[0].self_attn
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
    args = model.args
    head_dim = getattr(attn, "head_dim", None) or getattr(args, "head_dim", None)
    if head_dim is None:
        head_dim = args.hidden_size // args.num_attention_heads
    if n_kv is None:
        n_kv = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    return int(n_kv), int(head_dim)


def hidden_states(model: nn.Module, tokens: mx.array, caches: list[PagedLayerCache]) -> mx.array:
    """tokens: [T] -> final-norm hidden states [T, hidden]."""
    if caches[0].meta is not None and caches[0].meta.single_request:
        return model.model(tokens[None, :], cache=caches)[0]  # [1, T, hidden] -> [T, hidden]
    h = model.model(tokens[:, None], cache=caches)  # [T, 1, hidden]
    return h[:, 0, :]


def compute_logits(model: nn.Module, h: mx.array) -> mx.array:
    """h: [N, hidden] -> logits [N, vocab], the model's own head (tied or not, softcapped or not)."""
    head = getattr(model, "lm_head", None)
    logits = head(h) if head is not None else model.model.embed_tokens.as_linear(h)
    cap = getattr(model.args, "final_logit_softcapping", None)
    if cap:
        logits = mx.tanh(logits / cap) * cap
    return logits
