"""The trained MTP assistant's draft loop in C (mtp.c) for `MTPProposer`, on a float32 head-major KV cache
(docs/mtp.md); `"draft_backend": "mlx"` keeps the MLX module, its reference."""

from __future__ import annotations

import ctypes
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.cpu.build import build_kernel, kernel_reason
from engine.cpu.host import host_view, pointer
from engine.kv.cache import PagedKVCache
from engine.models.mtp_assistant import LoadedAssistant
from engine.models.mtp_trained import TrainedAssistant
from engine.models.weights import CpuEmbedding

SOURCE = Path(__file__).with_name("mtp.c")


class _Assistant(ctypes.Structure):  # the C struct Assistant, field for field
    _fields_ = [(name, ctypes.c_int) for name in
                ("backbone", "hidden", "heads", "kv_heads", "head_dim", "inter", "head_size")] + \
        [("eps", ctypes.c_float), ("rope_base", ctypes.c_float)] + \
        [(name, ctypes.c_void_p) for name in
         ("pre", "q", "o", "gate", "up", "down", "head", "post", "ln_in", "ln_post", "ln_final")]


def unsupported_reason(assistant: LoadedAssistant, kv: PagedKVCache, embed: nn.Module) -> str | None:
    """Why the C pass cannot serve this assistant here (None: it can); `embed`: the target's embedding."""
    why = draft_loop_reason()
    if why:
        return why
    net = assistant.module
    if not isinstance(net, TrainedAssistant):
        return "not a trained (specserve_mtp) assistant"
    if not kv.head_major or kv.dtype != mx.float32:
        return "the KV cache is not float32 head-major"
    if assistant.windows[0] is not None or net.config.get("rope_traditional"):
        return "sliding-window or traditional-RoPE attention"
    if embedding_table(embed) is None:
        return "the target's token embedding is not a float32 table"
    return None


def _f16(w: mx.array) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(w.astype(mx.float16)))


class CpuAssistant:
    """The assistant's weights as float16 copies, a view of the target's embedding and the C entry point."""

    def __init__(self, net: TrainedAssistant, embed: nn.Module, embed_scale: float,
                 isa: str | None = None) -> None:
        """`embed`: the target's token embedding, a float32 table (`unsupported_reason` checked)."""
        table = embedding_table(embed)
        assert table is not None
        self.lib = ctypes.CDLL(str(build_kernel(SOURCE, "mtp_cpu", isa)))
        self.lib.mtp_draft.restype = ctypes.c_int
        self.lib.mtp_step.restype = ctypes.c_int
        c = net.config
        self.backbone = int(c["backbone_hidden_size"])
        mats = {"pre": net.pre_projection, "q": net.self_attn.q_proj, "o": net.self_attn.o_proj,
                "gate": net.mlp.gate_proj, "up": net.mlp.up_proj, "down": net.mlp.down_proj,
                "head": net.head, "post": net.post_projection}
        self._keep = {k: _f16(m.weight) for k, m in mats.items()}  # alive while C holds pointers
        norms = {"ln_in": net.input_layernorm, "ln_post": net.post_attention_layernorm, "ln_final": net.norm}
        self._keep.update({k: np.ascontiguousarray(np.asarray(m.weight.astype(mx.float32)))
                           for k, m in norms.items()})
        self.spec = _Assistant(
            backbone=self.backbone, hidden=int(c["hidden_size"]), heads=int(c["num_attention_heads"]),
            kv_heads=int(c["num_key_value_heads"]), head_dim=int(c["head_dim"]),
            inter=int(c["intermediate_size"]), head_size=int(c["head_size"]), eps=float(c["rms_norm_eps"]),
            rope_base=float(c["rope_theta"]), **{k: v.ctypes.data for k, v in self._keep.items()})
        self.embed = table
        self.embed_scale = ctypes.c_float(embed_scale)
        self.head_ids = np.ascontiguousarray(np.asarray(net.vocab_ids), dtype=np.int32)
        # The loop reads embedding rows by head id and backbone columns each (checked at load too).
        if table.shape[1] != self.backbone or not 0 <= int(self.head_ids.min()) <= int(self.head_ids.max()) \
                < table.shape[0]:
            raise ValueError(f"the target's embedding table {table.shape} does not fit the assistant "
                             f"(backbone_hidden_size {self.backbone}, vocab_ids up to {self.head_ids.max()})")

    def _cache(self, keys: mx.array, values: mx.array) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy views of the evaluated cache, checked against the assistant's sizes (C reads them
        without bounds checks)."""
        k = host_view(keys)
        v = host_view(values)
        if k.shape != v.shape or k.shape[0] != self.spec.kv_heads or k.shape[2] != self.spec.head_dim:
            raise ValueError(f"mtp_draft: KV cache {k.shape} does not match the assistant's "
                             f"{self.spec.kv_heads} KV heads x {self.spec.head_dim}")
        return k, v

    def draft(self, tokens: list[int], hidden: np.ndarray, positions: list[int], tables: np.ndarray,
              block_size: int, keys: mx.array, values: mx.array, cuts: list[float], want: list[int]
              ) -> list[list[int]]:
        """Drafts per request: `hidden` [n, backbone], `tables` [n, L] block ids, keys/values the target
        layer's head-major cache, `cuts` draft_min_token_prob per position, `want` drafts wanted."""
        n, max_k = len(tokens), max(want)
        toks = np.array(tokens, dtype=np.int64)
        hid = np.array(hidden, dtype=np.float32)  # a copy: the C loop overwrites it
        pos = np.array(positions, dtype=np.int32)
        tab = np.ascontiguousarray(tables, dtype=np.int32)
        cut = np.array(cuts, dtype=np.float32)
        wanted = np.array(want, dtype=np.int32)
        k, v = self._cache(keys, values)
        out = np.empty((n, max_k), dtype=np.int32)
        lengths = np.empty(n, dtype=np.int32)
        rc = self.lib.mtp_draft(
            ctypes.byref(self.spec), ctypes.c_int(n), pointer(toks), pointer(hid), pointer(self.embed),
            self.embed_scale, pointer(self.head_ids), pointer(pos), pointer(tab), ctypes.c_int(tab.shape[1]),
            ctypes.c_int(block_size), pointer(k), pointer(v), ctypes.c_long(k.shape[1]), pointer(cut),
            ctypes.c_int(len(cut)), pointer(wanted), ctypes.c_int(max_k), pointer(out), pointer(lengths))
        if rc != 0:
            raise MemoryError("mtp_draft could not allocate its scratch memory")
        return [row[:n_r] for row, n_r in zip(out.tolist(), lengths.tolist(), strict=True)]

    def step(self, tokens: list[int], hidden: np.ndarray, positions: list[int], tables: np.ndarray,
             block_size: int, keys: mx.array, values: mx.array) -> np.ndarray:
        """One pass -> the head's logits [n, head_size]; `hidden` becomes the next pass's rows in place."""
        n = len(tokens)
        toks = np.array(tokens, dtype=np.int32)
        pos = np.array(positions, dtype=np.int32)
        tab = np.ascontiguousarray(tables, dtype=np.int32)
        k, v = self._cache(keys, values)
        if hidden.dtype != np.float32 or not hidden.flags.c_contiguous or hidden.shape != (n, self.backbone):
            raise ValueError(f"mtp_step: hidden must be a contiguous float32 [{n}, {self.backbone}] array")
        logits = np.empty((n, self.spec.head_size), dtype=np.float32)
        rc = self.lib.mtp_step(
            ctypes.byref(self.spec), ctypes.c_int(n), pointer(toks), pointer(hidden), pointer(self.embed),
            self.embed_scale, pointer(pos), pointer(tab), ctypes.c_int(tab.shape[1]),
            ctypes.c_int(block_size), pointer(k), pointer(v), ctypes.c_long(k.shape[1]), pointer(logits),
            pointer(hidden))
        if rc != 0:
            raise MemoryError("mtp_step could not allocate its scratch memory")
        return logits


def draft_loop_reason() -> str | None:
    """Why no draft head's C loop (mtp.c, eagle3.c) runs here, whatever the head (None: they can)."""
    why = kernel_reason()
    if why:
        return why
    return "MLX runs on a GPU" if mx.default_device() != mx.cpu else None


def embedding_table(embed: nn.Module) -> np.ndarray | None:
    """A float32 view of the target's token embedding (zero-copy where it is float32), or None."""
    if isinstance(embed, CpuEmbedding):  # stored in its own precision: a float32 copy
        return host_view(embed.float32_table())
    w = getattr(embed, "weight", None)
    if type(embed) is not nn.Embedding or w is None or w.dtype != mx.float32:
        return None
    return host_view(w)
