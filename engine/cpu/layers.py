"""The decoder layers of llama-family models (llama, mistral, qwen2, qwen3) and gemma3 in C (layers.c): one
call per step where the C kernels and attention run over a float32 head-major cache (docs/cpu-backend.md);
anything else keeps the MLX path, its reference. `SPECSERVE_CPU_LAYERS=off` turns it off."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, overload

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine import envs
from engine.attention.types import AttentionMetadata
from engine.cpu.build import build_kernel, selected_isa
from engine.cpu.host import host_view
from engine.cpu.qgemm import BLOCK_FORMATS, FORMATS, BlockWeights, PackedWeights
from engine.cpu.qgemm import unsupported_reason as qgemm_reason
from engine.cpu.threads import cpu_threads
from engine.kv.cache import PagedKVCache
from engine.models.adapter import aux_order
from engine.models.weights import CpuEmbedding, CpuLinear

SOURCE = Path(__file__).with_name("layers.c")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


class _Mat(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int), ("group", ctypes.c_int), ("sdtype", ctypes.c_int), ("n", ctypes.c_int),
                ("k", ctypes.c_int), ("w", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("biases", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [*[(n, _Mat) for n in ("q", "k", "v", "o", "gate", "up", "down")],
                ("ln_in", ctypes.c_void_p), ("ln_post", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p),
                ("window", ctypes.c_int), ("ln_attn_out", ctypes.c_void_p), ("ln_mlp_out", ctypes.c_void_p),
                ("rope2", ctypes.c_int)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int), ("hidden", ctypes.c_int), ("heads", ctypes.c_int),
                ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("inter", ctypes.c_int),
                ("rope_traditional", ctypes.c_int), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("rope_scale", ctypes.c_float), ("slots", ctypes.c_long), ("inv_freq", ctypes.c_void_p),
                ("layers", ctypes.POINTER(_Layer)), ("final_norm", ctypes.c_void_p),
                ("act_int8", ctypes.c_int), ("inv_freq2", ctypes.c_void_p), ("rope_scale2", ctypes.c_float),
                ("gelu", ctypes.c_int)]


@functools.cache
def _lib(isa: str | None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_kernel(SOURCE, "cpu_layers", isa)))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.layers_forward.restype = i
    lib.layers_forward.argtypes = [ctypes.POINTER(_Stack), i, p, p, p, p, p, i, i, i]
    lib.layers_forward_aux.restype = i
    lib.layers_forward_aux.argtypes = [ctypes.POINTER(_Stack), i, p, p, p, p, p, i, i, i, p, p, i]
    return lib


class _Unsupported(Exception):
    pass


def _f32(a: mx.array, keep: list[Any]) -> int:
    if a.dtype != mx.float32 or a.ndim != 1:
        raise _Unsupported(f"a norm weight or bias is {a.dtype} with shape {a.shape}")
    v = host_view(mx.contiguous(a))
    keep.append(v)
    return v.ctypes.data


def _mat(m: nn.Module, keep: list[Any]) -> _Mat:
    packed: PackedWeights | BlockWeights
    if isinstance(m, CpuLinear):
        packed = m._packed
    elif type(m) is nn.Linear and m.weight.dtype == mx.float32:
        packed = PackedWeights.floats(m.weight)
    else:
        raise _Unsupported(f"a {type(m).__name__} layer ({getattr(m, 'weight', mx.zeros(0)).dtype})")
    if not packed.supported():
        raise _Unsupported(f"a [{packed.n}, {packed.k}] {packed.fmt} weight the kernel cannot read")
    keep.append(packed)
    bias = _f32(m["bias"], keep) if "bias" in m else None
    if isinstance(packed, BlockWeights):
        return _Mat(BLOCK_FORMATS[packed.qtype][0], 0, 0, packed.n, packed.k, packed.view.ctypes.data, None,
                    None, bias)
    v = packed.views
    return _Mat(FORMATS[packed.fmt], packed.group, packed.scale_dtype, packed.n, packed.k, v[0].ctypes.data,
                v[1].ctypes.data if len(v) > 1 else None, v[2].ctypes.data if len(v) > 2 else None, bias)


def _is_gemma3(m: nn.Module) -> bool:
    return type(m).__module__ == "mlx_lm.models.gemma3_text"


def _gain(norm: nn.Module, keep: list[Any]) -> int:
    """An RMSNorm's gain as the C norm takes it: nn.RMSNorm's weight, gemma3's 1 + weight."""
    if type(norm) is nn.RMSNorm:
        return _f32(norm.weight, keep)
    if _is_gemma3(norm) and type(norm).__name__ == "RMSNorm":
        return _f32(1.0 + norm.weight.astype(mx.float32), keep)
    raise _Unsupported(f"norm {type(norm).__name__}")


def _inv_freq(base: float, head_dim: int) -> np.ndarray:
    half = head_dim // 2
    return (np.float64(base) ** (-np.arange(half, dtype=np.float64) / half)).astype(np.float32)


class CpuLayerStack:
    """The model's decoder layers as one C call; `hidden_states` replaces adapter.hidden_states."""

    def __init__(self, model: nn.Module, kv: PagedKVCache, windows: list[int | None],
                 isa: str | None = None, act_int8: int = 0) -> None:
        """`act_int8`: which products take 8-bit activations (weights.int8_products: 1 the 4-bit, 2 the
        8-bit ones)."""
        self.lib = _lib(isa or selected_isa())
        self.model = model
        self.kv = kv
        self._keep: list[Any] = []
        inner = model.model
        layers = list(inner.layers)
        attn0, rope = layers[0].self_attn, layers[0].self_attn.rope
        if type(rope) is not nn.RoPE:
            raise _Unsupported(f"RoPE variant {type(rope).__name__}")
        shape = kv.uniform_shape()
        if shape is None:
            raise _Unsupported("layers with different KV shapes or shared KV")
        n_kv, head_dim = shape
        n_heads = int(getattr(attn0, "n_heads", 0) or model.args.num_attention_heads)
        if rope.dims != head_dim:
            raise _Unsupported(f"partial rotary embedding ({rope.dims} of {head_dim} dims)")
        # gemma3: post-norms around attention and MLP, GELU, embeddings scaled by sqrt(hidden), its local
        # layers' RoPE base as the stack's second RoPE.
        gemma = _is_gemma3(layers[0])
        ropes = [(rope.base, rope.scale)]
        c_layers = (_Layer * len(layers))()
        eps = None
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            same = (a.rope.traditional, a.rope.dims) == (rope.traditional, rope.dims)
            if type(a.rope) is not nn.RoPE or not same:
                raise _Unsupported(f"RoPE variant {type(a.rope).__name__}")
            if (a.rope.base, a.rope.scale) not in ropes:
                ropes.append((a.rope.base, a.rope.scale))
            if len(ropes) > 2:
                raise _Unsupported("layers with more than two RoPE settings")
            if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) or (
                    gemma and not _is_gemma3(mlp)):
                raise _Unsupported(f"MLP {type(mlp).__name__}")
            pre_mlp = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
            post = [layer.post_attention_layernorm, layer.post_feedforward_layernorm] if gemma else []
            norms = [layer.input_layernorm, pre_mlp, *post]
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            for n in [*norms, *[x for x in (qn, kn) if x is not None]]:
                if eps is not None and n.eps != eps:
                    raise _Unsupported("norms with different eps")
                eps = n.eps
            cl = c_layers[i]
            for name, mod in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj),
                              ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj)):
                setattr(cl, name, _mat(mod, self._keep))
            cl.ln_in, cl.ln_post = _gain(norms[0], self._keep), _gain(norms[1], self._keep)
            if post:
                cl.ln_attn_out, cl.ln_mlp_out = _gain(post[0], self._keep), _gain(post[1], self._keep)
            cl.q_norm = _gain(qn, self._keep) if qn is not None else None
            cl.k_norm = _gain(kn, self._keep) if kn is not None else None
            cl.window = windows[i] or 0
            cl.rope2 = int(ropes.index((a.rope.base, a.rope.scale)))
        self.layers = c_layers
        inv_freq = [_inv_freq(base, head_dim) for base, _ in ropes]
        self._keep.extend(inv_freq)
        # gemma3 scales the embeddings by sqrt(hidden) rounded to bfloat16, as mlx-lm's model does.
        hidden = int(c_layers[0].q.k)
        self.embed_scale = (float(np.array(mx.array(hidden ** 0.5, mx.bfloat16).astype(mx.float32)))
                            if gemma else None)
        # The final norm and the embedding lookup join the C call where the kernels can run them.
        norm = inner.norm
        try:
            final_gain = _gain(norm, self._keep) if norm.eps == eps else None
        except _Unsupported:
            final_gain = None
        self.final_norm = final_gain is not None
        # Set by the first layer's norms; a uniform KV shape: every layer stores its own KV.
        assert eps is not None and kv.k[0] is not None
        self.stack = _Stack(len(layers), hidden, n_heads, n_kv, head_dim,
                            int(c_layers[0].gate.n), int(bool(rope.traditional)), float(eps),
                            float(attn0.scale), float(rope.scale), int(kv.k[0].shape[1]),
                            inv_freq[0].ctypes.data, c_layers, final_gain, int(act_int8),
                            inv_freq[1].ctypes.data if len(inv_freq) > 1 else None,
                            float(ropes[-1][1]), int(gemma))
        self._cache_arrays: list[mx.array | None] = []

    def _bind_cache(self) -> None:
        """Point the layers at the cache arrays (MLX replaces an array when it writes into it)."""
        arrays = [*self.kv.k, *self.kv.v]
        if len(arrays) == len(self._cache_arrays) and all(
                a is b for a, b in zip(arrays, self._cache_arrays, strict=True)):
            return
        mx.eval(arrays)
        n = len(self.kv.k)
        for i in range(n):
            k, v = self.kv.k[i], self.kv.v[i]
            assert k is not None and v is not None  # a uniform KV shape: every layer stores its own
            self.layers[i].kc = host_view(k).ctypes.data
            self.layers[i].vc = host_view(v).ctypes.data
        self._cache_arrays = arrays

    @overload
    def hidden_states(self, tokens: mx.array, meta: AttentionMetadata) -> mx.array: ...

    @overload
    def hidden_states(self, tokens: mx.array, meta: AttentionMetadata, *,
                      aux_layers: tuple[int, ...]) -> tuple[mx.array, mx.array]: ...

    def hidden_states(self, tokens: mx.array, meta: AttentionMetadata, *,
                      aux_layers: tuple[int, ...] | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """tokens: [T] -> final-norm hidden states [T, hidden]; with `aux_layers`, also adapter.hidden_states'
        aux states: the residual stream entering each layer, float32 [T, n_aux * hidden], ascending."""
        self._bind_cache()
        inner = self.model.model
        embed = inner.embed_tokens
        if isinstance(embed, CpuEmbedding):
            h = embed.rows(np.asarray(tokens))
        else:
            h = np.array(embed(tokens).astype(mx.float32), dtype=np.float32, copy=True)
        if self.embed_scale is not None:
            h *= np.float32(self.embed_scale)
        host = meta.host()
        slots = np.asarray(meta.slot_mapping, dtype=np.int32)
        t = h.shape[0]
        args = (ctypes.byref(self.stack), t, h.ctypes.data, host.positions.ctypes.data, slots.ctypes.data,
                host.token_table.ctypes.data, host.tables.ctypes.data, host.block_size, host.max_context,
                cpu_threads().count())
        ids = [] if aux_layers is None else aux_order(aux_layers, self.stack.num_layers)
        aux = np.empty((t, len(ids), h.shape[1]), np.float32)
        if ids:  # the C call copies the stream into aux[:, slot[l]] as it enters layer l
            slot = np.full(self.stack.num_layers + 1, -1, np.int32)
            slot[ids] = np.arange(len(ids), dtype=np.int32)
            rc = self.lib.layers_forward_aux(*args, aux.ctypes.data, slot.ctypes.data, len(ids))
        else:
            rc = self.lib.layers_forward(*args)
        if rc != 0:
            raise (MemoryError if rc == -1 else ValueError)(f"layers_forward failed ({rc})")
        out = mx.array(h) if self.final_norm else inner.norm(mx.array(h))
        return out if aux_layers is None else (out, mx.array(aux.reshape(t, -1)))


def build_stack(model: nn.Module, kv: PagedKVCache, windows: list[int | None],
                attention_is_cpu: bool, config: dict[str, Any],
                act_int8: int = 0) -> tuple[CpuLayerStack | None, str]:
    """The C layer stack for this model, or None and why not."""
    if envs.get("SPECSERVE_CPU_LAYERS") == "off":
        return None, "SPECSERVE_CPU_LAYERS=off"
    if not attention_is_cpu:
        return None, "the attention backend is not the C kernel"
    if (why := qgemm_reason()) is not None:
        return None, why
    if config.get("model_type") not in MODEL_TYPES:
        return None, f"model type {config.get('model_type')!r} (C layers: {', '.join(MODEL_TYPES)})"
    if not kv.head_major or kv.dtype != mx.float32:
        return None, "the KV cache is not float32 head-major"
    try:
        return CpuLayerStack(model, kv, windows, act_int8=act_int8), "C layers"
    except _Unsupported as e:
        return None, str(e)
    except (RuntimeError, OSError, ValueError) as e:
        return None, f"could not build engine/cpu/layers.c: {e}"
