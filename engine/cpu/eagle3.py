"""An EAGLE-3 head's draft loop in C (eagle3.c) for `Eagle3Proposer`, with the head's KV as host arrays;
`"draft_backend": "mlx"` keeps the MLX module, its reference."""

from __future__ import annotations

import ctypes
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.cpu.build import build_kernel
from engine.cpu.host import pointer
from engine.cpu.mtp import draft_loop_reason, embedding_table
from engine.cpu.threads import cpu_threads
from engine.models.eagle3 import LoadedEagle3

SOURCE = Path(__file__).with_name("eagle3.c")


class _Mat(ctypes.Structure):  # head_ops.h's HeadMat
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p)]


MATRICES = ("fc", "q", "k", "v", "o", "gate", "up", "down", "head")


class _Eagle3(ctypes.Structure):  # the C struct Eagle3, field for field
    _fields_ = [(name, ctypes.c_int) for name in
                ("hidden", "target_hidden", "heads", "kv_heads", "head_dim", "inter", "vocab",
                 "norm_before_residual")] + \
        [("eps", ctypes.c_float), ("rope_base", ctypes.c_float)] + \
        [(name, _Mat) for name in MATRICES] + \
        [(name, ctypes.c_void_p) for name in ("ln_in", "ln_hidden", "ln_post", "ln_final")]


class _HeadKV(ctypes.Structure):  # the C struct HeadKV
    _fields_ = [("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p), ("slots", ctypes.c_long),
                ("tables", ctypes.c_void_p), ("table_len", ctypes.c_int), ("block_size", ctypes.c_int)]


def unsupported_reason(loaded: LoadedEagle3) -> str | None:
    """Why the C loop cannot serve this head here (None: it can)."""
    why = draft_loop_reason()
    if why:
        return why
    cfg = loaded.config
    if cfg.rope_scaling:
        return "RoPE scaling"
    if cfg.hidden_size % 16 or cfg.head_dim % 2:
        return f"hidden size {cfg.hidden_size} or head dim {cfg.head_dim} the loop does not take"
    if embedding_table(loaded.head.embed) is None:
        return "the token embedding is not a float32 table"
    return None


def int8_rows(w: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (q int8 [out, in], scale float32 [out]), w ~ scale[:, None] * q (symmetric rows)."""
    x = np.asarray(w.astype(mx.float32))
    scale = np.abs(x).max(axis=1) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(x / scale[:, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q), scale.astype(np.float32)


class CpuEagle3:
    """The head's weight matrices as int8 rows with a scale each, a float32 view of its token embedding,
    its paged KV as host arrays [kv_heads, slots, head_dim] and the C entry point (`unsupported_reason`
    checked). The head's MLX modules take the int8 rows' values, so both backends run one set of weights
    (drafts never reach outputs unverified, so the rounding costs acceptance only)."""

    def __init__(self, loaded: LoadedEagle3, num_blocks: int, block_size: int,
                 isa: str | None = None) -> None:
        head, cfg = loaded.head, loaded.config
        table = embedding_table(head.embed)
        assert table is not None
        self.lib = ctypes.CDLL(str(build_kernel(SOURCE, "eagle3_cpu", isa)))
        self.lib.eagle3_draft.restype = ctypes.c_int
        mats = {"fc": head.fc, "q": head.q_proj, "k": head.k_proj, "v": head.v_proj, "o": head.o_proj,
                "gate": head.gate_proj, "up": head.up_proj, "down": head.down_proj, "head": head.lm_head}
        self._keep: dict[str, np.ndarray] = {}  # alive while C holds pointers
        c_mats = {}
        for name, m in mats.items():
            q, scale = int8_rows(m.weight)
            m.weight = (mx.array(q, dtype=mx.float32) * mx.array(scale)[:, None]).astype(m.weight.dtype)
            self._keep[name], self._keep[f"{name}_scale"] = q, scale
            c_mats[name] = _Mat(q.ctypes.data, scale.ctypes.data)
        mx.eval(head.parameters())
        norms = {"ln_in": head.input_layernorm, "ln_hidden": head.hidden_norm,
                 "ln_post": head.post_attention_layernorm, "ln_final": head.norm}
        self._keep.update({k: np.ascontiguousarray(np.asarray(m.weight.astype(mx.float32)))
                           for k, m in norms.items()})
        self.spec = _Eagle3(
            hidden=cfg.hidden_size, target_hidden=cfg.target_hidden_size, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, inter=cfg.intermediate_size,
            vocab=cfg.draft_vocab_size, norm_before_residual=int(cfg.norm_before_residual),
            eps=cfg.rms_norm_eps, rope_base=cfg.rope_theta, **c_mats,
            **{k: v.ctypes.data for k, v in self._keep.items() if k.startswith("ln_")})
        self.embed = table
        ids = np.arange(cfg.draft_vocab_size, dtype=np.int64)
        if head.d2t is not None:
            ids = ids + np.asarray(head.d2t, dtype=np.int64)
        self.ids = np.ascontiguousarray(ids, dtype=np.int32)
        if table.shape[1] != cfg.hidden_size:
            raise ValueError(f"the token embedding {table.shape} does not fit the head's width "
                             f"{cfg.hidden_size}")
        self.block_size = block_size
        shape = (cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim)
        self.keys = np.zeros(shape, dtype=np.float32)
        self.values = np.zeros(shape, dtype=np.float32)

    @staticmethod
    def bytes_per_block(loaded: LoadedEagle3, block_size: int) -> int:
        return 2 * loaded.config.num_kv_heads * loaded.config.head_dim * block_size * 4

    def draft(self, counts: list[int], tokens: list[int], feats: np.ndarray, first: list[int],
              tables: list[list[int]], want: list[int]) -> list[list[int]]:
        """Drafts per request: counts[r] catch-up rows (tokens, and `feats` [rows, 3 * target hidden]
        float32) from position first[r], then want[r] drafts; tables[r] covers every slot they write."""
        n, max_k = len(counts), max(1, *want)
        cnt = np.array(counts, dtype=np.int32)
        if n == 0 or int(cnt.min()) < 1 or feats.shape != (int(cnt.sum()), 3 * self.spec.target_hidden) \
                or len(tokens) != feats.shape[0]:
            raise ValueError(f"eagle3_draft: {feats.shape} features for counts {counts}")
        width = max(len(t) for t in tables)
        tab = np.zeros((n, width), dtype=np.int32)
        for r, (t, f, c, w) in enumerate(zip(tables, first, counts, want, strict=True)):
            if (f + c - 1 + max(0, w - 1)) // self.block_size >= len(t):  # C writes those slots unchecked
                raise ValueError(f"eagle3_draft: request {r}'s block table is too short")
            tab[r, : len(t)] = t
        kv = _HeadKV(kc=self.keys.ctypes.data, vc=self.values.ctypes.data, slots=self.keys.shape[1],
                     tables=tab.ctypes.data, table_len=width, block_size=self.block_size)
        toks = np.array(tokens, dtype=np.int32)
        x = np.ascontiguousarray(feats, dtype=np.float32)
        fst = np.array(first, dtype=np.int32)
        wanted = np.array(want, dtype=np.int32)
        out = np.zeros((n, max_k), dtype=np.int32)
        rc = self.lib.eagle3_draft(
            ctypes.byref(self.spec), ctypes.byref(kv), ctypes.c_int(n), pointer(cnt), pointer(toks),
            pointer(x), pointer(self.embed), pointer(self.ids), pointer(fst), pointer(wanted),
            ctypes.c_int(max_k), pointer(out), ctypes.c_int(cpu_threads().count()))
        if rc != 0:
            raise MemoryError("eagle3_draft could not allocate its scratch memory")
        return [row[:w] for row, w in zip(out.tolist(), want, strict=True)]
