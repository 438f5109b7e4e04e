"""EAGLE-3 proposer: a one-layer head drafts from the target's fused layer features and its own paged KV,
which sits at the target's block ids (one block table, and prefix-cached blocks carry the head's KV too).

Row j of the head pairs token j + 1 with the target's features at position j and writes KV slot j, so
draft 1 comes from the row of the newest token; later drafts feed the head's own output back one
position further. Every step's features are taken in (catch-up), drafting or not; rows written by drafts
are overwritten by the next catch-up (docs/speculative-decoding.md#eagle-3).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from engine.attention.reference import paged_attention_reference
from engine.attention.selector import cpu_attention_fits
from engine.attention.types import build_metadata
from engine.cpu import eagle3 as eagle3_cpu
from engine.cpu.attention import cpu_paged_attention
from engine.cpu.host import int_list
from engine.kv.cache import PagedKVCache
from engine.models.eagle3 import LoadedEagle3
from engine.spec.proposer import DraftRequest
from engine.step import FeatureRows

logger = logging.getLogger(__name__)


class Eagle3Proposer:
    drafts_before_choice = False  # each draft token costs a head pass: K is chosen first
    filters_drafts = False
    shares_target_blocks = True

    def __init__(self, loaded: LoadedEagle3, num_blocks: int, block_size: int,
                 attention_fn: Callable[..., mx.array] = paged_attention_reference,
                 use_c: bool = True) -> None:
        """`num_blocks`: the target's KV blocks; `use_c`: the C draft loop where it applies (`cpu_reason`
        says why not), else MLX modules."""
        cfg = loaded.config
        self.head = loaded.head
        self.cpu_reason = eagle3_cpu.unsupported_reason(loaded) if use_c else "draft_backend: mlx"
        self.cpu: eagle3_cpu.CpuEagle3 | None = None
        if self.cpu_reason is None:
            try:
                self.cpu = eagle3_cpu.CpuEagle3(loaded, num_blocks, block_size)
            except (RuntimeError, OSError) as e:  # no compiler, or the library does not load
                self.cpu_reason = f"C pass unavailable: {e}"
        logger.info("EAGLE-3 head passes: %s", "C (engine/cpu/eagle3.c)" if self.cpu is not None
                    else f"MLX ({self.cpu_reason})")
        self.kv_cache = None if self.cpu else \
            PagedKVCache([(cfg.num_kv_heads, cfg.head_dim)], num_blocks, block_size, loaded.dtype)
        # The C kernel where it reads this cache (another dtype: the reference path).
        if attention_fn is cpu_paged_attention and self.kv_cache and cpu_attention_fits(self.kv_cache):
            attention_fn = paged_attention_reference
        self.attention_fn = attention_fn
        # Per request: positions below this hold KV made from target features (the next catch-up starts
        # there; a new request starts at its first feature, the rows before are prefix-cached blocks'),
        # and features received but not yet consumed.
        self._done: dict[str, int] = {}
        self._pending: dict[str, list[FeatureRows]] = {}

    @staticmethod
    def bytes_per_block(loaded: LoadedEagle3, block_size: int) -> int:
        cfg = loaded.config  # the larger of the two backends' (C keeps float32 KV)
        return max(PagedKVCache.bytes_per_block([(cfg.num_kv_heads, cfg.head_dim)], block_size, loaded.dtype),
                   eagle3_cpu.CpuEagle3.bytes_per_block(loaded, block_size))

    def catch_up_tokens(self, request: DraftRequest) -> int:
        return max(0, len(request.token_ids) - 1 - self._done.get(request.request_id, 0))

    def draft_probs(self) -> dict[str, np.ndarray]:
        return {}

    def release(self, request_id: str, finished: bool) -> None:
        self._done.pop(request_id, None)
        self._pending.pop(request_id, None)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[_Rows] = []
        for i, r in enumerate(requests):
            got = self._catch_up_rows(r, i)
            if got is not None:
                rows.append(got)
        if not rows:
            return drafts
        got_drafts = self._draft_c(rows) if self.cpu else self._draft_mlx(rows)
        for w, d in zip(rows, got_drafts, strict=True):
            drafts[w.at] = d
            self._done[w.request.request_id] = w.first + len(w.tokens)
        return drafts

    def _catch_up_rows(self, r: DraftRequest, at: int) -> _Rows | None:
        """The rows `r` runs: positions done .. E - 1 (E: the end of its contiguous features, at most n - 1),
        drafting from the last when E is n - 1; None when it has none. Consumed features are dropped."""
        rid, n = r.request_id, len(r.token_ids)
        pending = self._pending.setdefault(rid, [])
        pending.extend(r.features)
        if rid not in self._done and pending:
            self._done[rid] = pending[0].start
        done = self._done.get(rid, 0)
        pending[:] = [f for f in pending if f.end > done]
        if pending and pending[0].start > done:  # a gap (a failed step): those rows keep older KV
            done = self._done[rid] = pending[0].start
        use: list[FeatureRows] = []
        for f in pending:
            if use and f.start != use[-1].end:
                break
            use.append(f)
        end = min(use[-1].end, n - 1) if use else done
        if end <= done:
            return None
        feats = mx.concatenate([f.rows for f in use], axis=0) if len(use) > 1 else use[0].rows
        return _Rows(r, done, r.token_ids[done + 1: end + 1], feats[done - use[0].start: end - use[0].start],
                     r.num_drafts if end == n - 1 else 0, list(r.block_table or []), at)

    def _draft_c(self, rows: list[_Rows]) -> list[list[int]]:
        assert self.cpu is not None
        feats = mx.concatenate([w.feats for w in rows], axis=0).astype(mx.float32)
        return self.cpu.draft([len(w.tokens) for w in rows], [t for w in rows for t in w.tokens],
                              np.asarray(feats), [w.first for w in rows], [w.table for w in rows],
                              [w.want for w in rows])

    def _draft_mlx(self, rows: list[_Rows]) -> list[list[int]]:
        hidden = self.head.fuse(mx.concatenate([w.feats for w in rows], axis=0))
        logits, out = self._run([t for w in rows for t in w.tokens],
                                hidden, [(w.first, len(w.tokens), w.table) for w in rows])
        ends = np.cumsum([len(w.tokens) for w in rows]) - 1
        live = [j for j, w in enumerate(rows) if w.want > 0]  # the request of each row of h
        drafts: list[list[int]] = [[] for _ in rows]
        if not live:
            return drafts
        pick = mx.array(ends[live])
        h = out[pick]
        for j, t in zip(live, self._choose(logits[pick]), strict=True):
            drafts[j].append(t)
        step = 1
        while keep := [i for i, j in enumerate(live) if rows[j].want > step]:
            live = [live[i] for i in keep]
            chunks = [(rows[j].first + len(rows[j].tokens) - 1 + step, 1, rows[j].table) for j in live]
            logits, h = self._run([drafts[j][-1] for j in live], h[mx.array(keep)], chunks)
            for j, t in zip(live, self._choose(logits), strict=True):
                drafts[j].append(t)
            step += 1
        return drafts

    def _run(self, tokens: list[int], hidden: mx.array,
             chunks: list[tuple[int, int, list[int]]]) -> tuple[mx.array, mx.array]:
        assert self.kv_cache is not None
        meta = build_metadata(chunks, self.kv_cache.block_size)
        return self.head(mx.array(tokens, dtype=mx.int32), hidden, self.kv_cache, meta, self.attention_fn)

    def _choose(self, logits: mx.array) -> list[int]:
        return int_list(self.head.target_ids(mx.argmax(logits, axis=-1).astype(mx.int32)))


class _Rows(NamedTuple):
    """One request's head pass: tokens at positions first.. with their features, then `want` drafts."""
    request: DraftRequest
    first: int
    tokens: list[int]
    feats: mx.array  # [len(tokens), 3 * target hidden]
    want: int
    table: list[int]  # the target's block table
    at: int  # its index in propose's request list
