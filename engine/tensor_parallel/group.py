"""The tensor-parallel group: joining it, sharding the model (mlx-lm's `model.shard`), and rank 0's step
broadcast; collectives run only inside the forward, on every rank in the same order."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine import envs
from engine.cpu.host import int_list
from engine.tensor_parallel.launcher import launched_rank
from engine.tensor_parallel.padding import pad_heads

logger = logging.getLogger(__name__)

_FORWARD, _STOP = 1, 2
Chunk = tuple[list[int], int, list[int], int]  # (token_ids, start_pos, block_table, num_logits)


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
        """Split the layers with mlx-lm's sharding, padding heads first where the rank count does not divide
        them. ValueError for a family mlx-lm cannot shard."""
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
        if not self.leader:
            values = [0] * n
        assert values is not None  # rank 0 passes its values
        a = mx.array(values, dtype=mx.int32)
        return int_list(mx.distributed.all_sum(a, group=self.group))

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
