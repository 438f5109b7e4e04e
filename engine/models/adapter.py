"""Run mlx-lm model classes unchanged over the paged KV cache: a step is one flat batch `[T, 1, hidden]` (one
request: `[1, T, hidden]`) and each layer's `cache` a `PagedLayerCache` that writes the new rows and routes
attention to paged attention."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, overload

import mlx.core as mx
import mlx.nn as nn

from engine.attention.reference import LOG2E, paged_attention_reference
from engine.attention.types import AttentionMetadata
from engine.kv.cache import KVShape, PagedKVCache, uniform_shape

_PATCHED_ATTR = "_specserve_paged"


class PagedLayerCache:
    """One model layer's view of the paged KV: `layer` is the KV layer it reads (another one's when the
    model shares KV: then `writes` is False)."""

    def __init__(self, kv: PagedKVCache, layer: int, window: int | None, writes: bool = True) -> None:
        self.kv = kv
        self.layer = layer
        self.window = window
        self.writes = writes
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
        if not self.writes:
            return keys, values
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
    """silu(gate) * x with a power-of-two exponential (MLX's CPU `sigmoid` is several times dearer;
    docs/design-notes.md). Agrees with mlx-lm's to ~5e-7 relative."""
    return gate * x / (1.0 + mx.power(2.0, gate * -LOG2E))


def install(model: nn.Module) -> None:
    """Route the model module's attention through `PagedLayerCache` when one is passed, and on the CPU its
    SwiGLU through `swiglu_pow2`: both are module globals, so everything running the module sees them."""
    mod: Any = sys.modules[type(model).__module__]
    fn = getattr(mod, "scaled_dot_product_attention", None)
    if fn is None:
        raise ValueError(
            f"model module {mod.__name__} does not call mlx-lm's scaled_dot_product_attention; "
            "its architecture is not supported on the paged cache")
    if not getattr(fn, _PATCHED_ATTR, False):
        mod.scaled_dot_product_attention = _dispatching_sdpa(fn)
    from mlx_lm.models.activations import swiglu  # mlx_lm loads transformers (~2 s)

    if getattr(mod, "swiglu", None) is swiglu and mx.default_device() == mx.cpu:
        mod.swiglu = swiglu_pow2


@dataclass(frozen=True)
class KVLayout:
    """Where each decoder layer's KV lives, per model layer: `shapes` (KV heads, head size) it stores (None:
    none), `sources` the layer whose KV it reads, `windows` its sliding window (None: full)."""

    shapes: list[KVShape | None]
    sources: list[int]
    windows: list[int | None]


def _layer_kv_shape(model: nn.Module, attn: nn.Module) -> KVShape:
    args = model.args
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
    head_dim = getattr(attn, "head_dim", None) or getattr(args, "head_dim", None)
    if head_dim is None:
        head_dim = args.hidden_size // args.num_attention_heads
    if n_kv is None:
        n_kv = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    return int(n_kv), int(head_dim)


def kv_layout(model: nn.Module) -> KVLayout:
    """Per-layer KV shapes, sharing and windows as mlx-lm builds the model: attention sizes, Gemma4's
    `previous_kvs` and the caches `make_cache` would give."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache  # mlx_lm loads transformers (~2 s)

    layers = list(model.layers)
    n = len(layers)
    inner = getattr(model, "model", None)
    sources = [int(i) for i in getattr(inner, "previous_kvs", range(n))]
    stores = [i for i in range(n) if sources[i] == i]
    if any(sources[sources[i]] != sources[i] for i in range(n)):
        raise ValueError("a KV-shared layer reads a layer that itself shares: not supported")
    made = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in range(n)]
    if len(made) < len(stores):
        raise ValueError(f"the model builds {len(made)} caches for {len(stores)} KV-storing layers")
    own: dict[int, int | None] = {}
    for i, c in zip(stores, made, strict=False):
        if isinstance(c, RotatingKVCache):
            own[i] = c.max_size
        elif isinstance(c, KVCache):
            own[i] = None
        else:
            raise ValueError(f"layer {i} uses {type(c).__name__}: not an attention KV cache; "
                             "this architecture is not supported")
    shapes: list[KVShape | None] = [
        _layer_kv_shape(model, layers[i].self_attn) if sources[i] == i else None for i in range(n)]
    return KVLayout(shapes=shapes, sources=sources, windows=[own[sources[i]] for i in range(n)])


def describe_layout(layout: KVLayout) -> str:
    """For the start-up log: '30 layers, 3 KV heads x 64' or the count of each shape and of shared layers."""
    counts: dict[KVShape, int] = {}
    for sh in layout.shapes:
        if sh is not None:
            counts[sh] = counts.get(sh, 0) + 1
    parts = [f"{c} layers, {n} KV heads x {d}" for (n, d), c in counts.items()]
    shared = sum(s is None for s in layout.shapes)
    if shared:
        parts.append(f"{shared} layers reading another layer's KV")
    return "; ".join(parts)


def layer_windows(model: nn.Module) -> list[int | None]:
    """Sliding-window size per layer."""
    return kv_layout(model).windows


def kv_shape(model: nn.Module) -> KVShape:
    """(num_kv_heads, head_dim) for code that needs one shape (the C layer stack, trained assistants);
    ValueError where layers differ or share KV."""
    shape = uniform_shape(kv_layout(model).shapes)
    if shape is None:
        raise ValueError("the model's layers have different KV shapes or share KV")
    return shape


def make_caches(model: nn.Module, kv: PagedKVCache) -> list[PagedLayerCache]:
    """One view per decoder layer over `kv` (built from `kv_layout(model).shapes`)."""
    layout = kv_layout(model)
    return [PagedLayerCache(kv, src, w, writes=src == i)
            for i, (src, w) in enumerate(zip(layout.sources, layout.windows, strict=True))]


def aux_order(aux_layers: tuple[int, ...], num_layers: int) -> list[int]:
    """The aux layer ids ascending (the aux columns' order, as vLLM gathers them); ValueError for a repeated
    id or one outside [0, num_layers] (num_layers: the last layer's output, before the final norm)."""
    ids = sorted(int(i) for i in aux_layers)
    if len(set(ids)) != len(ids) or any(not 0 <= i <= num_layers for i in ids):
        raise ValueError(f"aux layer ids {list(aux_layers)}: want distinct ids in [0, {num_layers}]")
    return ids


_TAP_ATTR = "_specserve_aux_tap"
_TAPPED: dict[type, type] = {}


def _tapped(cls: type) -> type:
    """`cls` with a call that first hands its input to the instance's tap: swapped in as the instance's class,
    so the model's own code (attribute reads, isinstance) sees the same module."""
    sub = _TAPPED.get(cls)
    if sub is None:
        def __call__(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            self.__dict__[_TAP_ATTR](x)
            return cls.__call__(self, x, *args, **kwargs)

        sub = _TAPPED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                          "__qualname__": cls.__qualname__})
    return sub


@contextmanager
def layer_input_taps(model: nn.Module, aux_layers: tuple[int, ...]) -> Iterator[list[mx.array]]:
    """Inside the block, the model's calls record the input of each asked layer (ascending ids; id L: the
    final norm's input) into the yielded list; the taps are gone on exit, whatever happens."""
    inner = model.model
    layers = list(inner.layers)
    ids = aux_order(aux_layers, len(layers))
    mods = [layers[i] if i < len(layers) else inner.norm for i in ids]
    classes = [type(m) for m in mods]
    seen: list[mx.array | None] = [None] * len(ids)
    out: list[mx.array] = []
    try:
        for j, m in enumerate(mods):
            m.__dict__[_TAP_ATTR] = partial(seen.__setitem__, j)
            m.__class__ = _tapped(classes[j])
        yield out
    finally:  # nothing else sees the taps
        for m, cls in reversed(list(zip(mods, classes, strict=True))):
            m.__class__ = cls
            m.__dict__.pop(_TAP_ATTR, None)
    if any(a is None for a in seen):
        raise RuntimeError(f"the model did not call every asked layer ({ids})")
    out.extend(a for a in seen if a is not None)


@overload
def hidden_states(model: nn.Module, tokens: mx.array, caches: list[PagedLayerCache]) -> mx.array: ...


@overload
def hidden_states(model: nn.Module, tokens: mx.array, caches: list[PagedLayerCache], *,
                  aux_layers: tuple[int, ...]) -> tuple[mx.array, mx.array]: ...


def hidden_states(model: nn.Module, tokens: mx.array, caches: list[PagedLayerCache], *,
                  aux_layers: tuple[int, ...] | None = None) -> mx.array | tuple[mx.array, mx.array]:
    """tokens: [T] -> final-norm hidden states [T, hidden]. With `aux_layers` (see aux_order): also the
    residual stream entering each of those layers, before any norm (HF's `hidden_states[i]`; id 0: the
    embeddings), as [T, n_aux * hidden] in ascending layer order (EAGLE-3's features)."""
    inner = model.model
    single = caches[0].meta is not None and caches[0].meta.single_request
    x = tokens[None, :] if single else tokens[:, None]  # [1, T] or [T, 1]: see the module docstring
    if aux_layers is None:
        h = inner(x, cache=caches)
        return h[0] if single else h[:, 0, :]
    with layer_input_taps(model, aux_layers) as seen:
        h = inner(x, cache=caches)
    h = h[0] if single else h[:, 0, :]
    rows = [a.reshape(-1, a.shape[-1]) for a in seen]  # [T, 1, D] or [1, T, D] -> [T, D]
    aux = mx.concatenate(rows, axis=-1) if rows else mx.zeros((h.shape[0], 0), h.dtype)
    return h, aux


def compute_logits(model: nn.Module, h: mx.array) -> mx.array:
    """h: [N, hidden] -> logits [N, vocab], the model's own head (tied or not, softcapped or not)."""
    head = getattr(model, "lm_head", None)
    logits = head(h) if head is not None else model.model.embed_tokens.as_linear(h)
    cap = getattr(model.args, "final_logit_softcapping", None)
    if cap:
        logits = mx.tanh(logits / cap) * cap
    return logits
