"""Tensor parallelism over MLX's distributed layer (`mx.distributed`: ring over TCP, MPI, JACCL).

Every rank holds a slice of each layer (mlx-lm's `model.shard(group)`: attention heads and MLP columns,
one all-sum after the attention output and one after the MLP) and the matching slice of the paged KV
cache (its own KV heads, the same block tables). Rank 0 is the whole engine (HTTP server, scheduler,
sampling, speculation); before each forward pass it broadcasts the step's inputs and the other ranks
run the same forward over their slice (`follow`). Collectives run only inside the forward, on every rank
in the same order, so a rank never needs to know more than the chunks of the step.

Heads that the rank count does not divide (SmolLM2-135M: 9 query / 3 KV heads on 2 ranks) are padded
with zero heads before sharding: zero query, key and value rows and zero output-projection columns add
exactly nothing to the output, and every rank then holds whole GQA groups.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine import envs

logger = logging.getLogger(__name__)

_FORWARD, _STOP = 1, 2
Chunk = tuple[list[int], int, list[int], int]  # (token_ids, start_pos, block_table, num_logits)


def launched_rank() -> int | None:
    """This process's rank when MLX's launcher started it (MLX_RANK), else None."""
    rank = os.environ.get("MLX_RANK")
    return int(rank) if rank is not None else None


@dataclass
class TensorParallel:
    group: mx.distributed.Group

    @classmethod
    def init(cls, size: int) -> TensorParallel:
        """Join the group MLX's launcher set up (its environment names the backend and the peers)."""
        if launched_rank() is None:
            raise ValueError(f"--tensor-parallel-size {size}: this process was not started by MLX's launcher "
                             "(`specserve serve --tensor-parallel-size N` starts its ranks itself)")
        group = mx.distributed.init(strict=True, backend=envs.get("SPECSERVE_TP_BACKEND"))
        if group.size() != size:
            raise ValueError(f"--tensor-parallel-size {size}, but MLX's launcher started {group.size()} "
                             "ranks")
        return cls(group)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- weights ---------------------------------------------------------------------------------
    def shard(self, model: nn.Module) -> None:
        """Split the model's layers over the group with mlx-lm's own sharding, padding heads first where
        the rank count does not divide them. Raises ValueError for a family mlx-lm cannot shard."""
        if not hasattr(model, "shard"):
            raise ValueError(f"--tensor-parallel-size {self.size}: mlx-lm has no tensor-parallel sharding "
                             f"for {type(model).__module__.rsplit('.', 1)[-1]} models (families with it: "
                             "llama, qwen2, qwen3, qwen3_moe, deepseek_v2/v3, glm4_moe, gpt_oss, "
                             "minimax, ...)")
        padded = pad_heads(model, self.size)
        model.shard(self.group)
        if padded:
            logger.info("tensor parallel: %s padded with zero heads to split over %d ranks", padded,
                        self.size)

    # -- the step's inputs, rank 0 to the others -------------------------------------------------
    def broadcast(self, values: list[int] | None, n: int) -> list[int]:
        """Rank 0's `values` (n ints) on every rank: an all-sum where the others add zeros."""
        a = mx.array(values if self.leader else [0] * n, dtype=mx.int32)
        return mx.distributed.all_sum(a, group=self.group).tolist()

    def send_forward(self, chunks: list[Chunk]) -> None:
        payload = encode_chunks(chunks)
        self.broadcast([_FORWARD, len(payload)], 2)
        self.broadcast(payload, len(payload))

    def send_stop(self) -> None:
        self.broadcast([_STOP, 0], 2)

    def receive(self) -> list[Chunk] | None:
        """The next step's chunks, or None when rank 0 stops."""
        cmd, n = self.broadcast(None, 2)
        if cmd == _STOP:
            return None
        if cmd != _FORWARD:
            raise RuntimeError(f"tensor parallel: unknown command {cmd} from rank 0")
        return decode_chunks(self.broadcast(None, n))


def encode_chunks(chunks: list[Chunk]) -> list[int]:
    out = [len(chunks)]
    for toks, start, table, num_logits in chunks:
        out += [len(toks), start, len(table), num_logits, *toks, *table]
    return out


def decode_chunks(data: list[int]) -> list[Chunk]:
    chunks: list[Chunk] = []
    i = 1
    for _ in range(data[0]):
        nt, start, nb, num_logits = data[i : i + 4]
        i += 4
        toks, table = data[i : i + nt], data[i + nt : i + nt + nb]
        i += nt + nb
        chunks.append((toks, start, table, num_logits))
    return chunks


# -- padding heads --------------------------------------------------------------------------------
def pad_heads(model: nn.Module, ranks: int) -> str | None:
    """Pad each attention layer's KV heads (and their query groups) with zero heads up to a multiple of
    `ranks`; returns a description for the log, or None when nothing needed padding. Works on
    llama-style attention (q/k/v/o projections, `n_heads`, `n_kv_heads`) with float or affine-quantized
    weights; raises ValueError where the heads do not divide and the layer is not of that shape."""
    desc = None
    for layer in model.model.layers:
        attn = layer.self_attn
        n_kv = getattr(attn, "n_kv_heads", None)
        n_q = getattr(attn, "n_heads", None)
        if n_kv is None or n_q is None:
            raise ValueError("tensor parallel: the attention layers do not name their head counts")
        if n_kv % ranks == 0:
            continue
        projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if any(p is None for p in projections):
            raise ValueError(f"tensor parallel: {n_kv} KV heads do not split over {ranks} ranks, and this "
                             "attention is not llama-shaped (q/k/v/o projections) for zero-head padding")
        q, k, v, o = projections
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
    """`m` with `cols` zero input features appended (packed and per-group arrays of a quantized layer)."""
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
