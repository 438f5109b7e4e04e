"""EAGLE-3 proposer: a one-layer head drafts from the target's fused layer features and its own paged KV.

Row j of the head pairs token j + 1 with the target's features at position j and writes KV slot j, so
draft 1 comes from the row of the newest token; later drafts feed the head's own output back one
position further. Rows written by drafts are overwritten by the next catch-up (docs/speculative-decoding.md).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.attention.reference import paged_attention_reference
from engine.attention.selector import cpu_attention_fits
from engine.attention.types import build_metadata
from engine.cpu.attention import cpu_paged_attention
from engine.cpu.host import int_list
from engine.kv.block_manager import KVCacheManager
from engine.kv.cache import PagedKVCache
from engine.models.eagle3 import LoadedEagle3
from engine.spec.proposer import DraftRequest
from engine.step import FeatureRows


class Eagle3Proposer:
    drafts_before_choice = False  # each draft token costs a head pass: K is chosen first
    filters_drafts = False

    def __init__(self, loaded: LoadedEagle3, num_blocks: int, block_size: int,
                 attention_fn: Callable[..., mx.array] = paged_attention_reference) -> None:
        cfg = loaded.config
        self.head = loaded.head
        self.kv_cache = PagedKVCache([(cfg.num_kv_heads, cfg.head_dim)], num_blocks, block_size, loaded.dtype)
        # The C kernel where it reads this cache (another dtype: the reference path).
        if attention_fn is cpu_paged_attention and cpu_attention_fits(self.kv_cache) is not None:
            attention_fn = paged_attention_reference
        self.attention_fn = attention_fn
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        # Per request: positions below this hold KV made from target features (the next catch-up starts
        # there), and features received but not yet consumed.
        self._done: dict[str, int] = {}
        self._pending: dict[str, list[FeatureRows]] = {}

    @staticmethod
    def bytes_per_block(loaded: LoadedEagle3, block_size: int) -> int:
        cfg = loaded.config
        return PagedKVCache.bytes_per_block([(cfg.num_kv_heads, cfg.head_dim)], block_size, loaded.dtype)

    def catch_up_tokens(self, request: DraftRequest) -> int:
        return max(0, len(request.token_ids) - 1 - self._done.get(request.request_id, 0))

    def draft_probs(self) -> dict[str, np.ndarray]:
        return {}

    def release(self, request_id: str, finished: bool) -> None:
        self._done.pop(request_id, None)
        self._pending.pop(request_id, None)
        self.kv.free(request_id)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[tuple[int, DraftRequest, mx.array]] = []  # (index, request, its catch-up rows' features)
        for i, r in enumerate(requests):
            self._pending.setdefault(r.request_id, []).extend(r.features)
            feats = self._catch_up_features(r)
            done = self._done.get(r.request_id, 0)
            # Slots up to the last position a draft writes: n - 2 + (K - 1).
            last = len(r.token_ids) - 2 + r.num_drafts - 1
            if feats is not None and self.kv.allocate_slots(r.request_id, done, last + 1 - done):
                active.append((i, r, feats))
        if not active:
            return drafts
        tokens: list[int] = []
        chunks: list[tuple[int, int, list[int]]] = []
        for _, r, _ in active:
            done = self._done.get(r.request_id, 0)
            tokens.extend(r.token_ids[done + 1:])
            chunks.append((done, len(r.token_ids) - 1 - done, self.kv.block_table(r.request_id)))
        hidden = self.head.fuse(mx.concatenate([f for _, _, f in active], axis=0))
        logits, out = self._run(tokens, hidden, chunks)
        ends = mx.array(np.cumsum([n for _, n, _ in chunks]) - 1)
        toks, h = self._choose(logits[ends]), out[ends]
        for (i, r, _), t in zip(active, toks, strict=True):
            drafts[i].append(t)
            self._done[r.request_id] = len(r.token_ids) - 1
        step = 1
        while live := [j for j, (_, r, _) in enumerate(active) if r.num_drafts > step]:
            chunks = [(len(r.token_ids) - 2 + step, 1, self.kv.block_table(r.request_id))
                      for r in (active[j][1] for j in live)]
            logits, h = self._run([drafts[active[j][0]][-1] for j in live], h[mx.array(live)], chunks)
            for j, t in zip(live, self._choose(logits), strict=True):
                drafts[active[j][0]].append(t)
            active = [active[j] for j in live]
            step += 1
        return drafts

    def _catch_up_features(self, r: DraftRequest) -> mx.array | None:
        """The features of positions done .. n - 2 (the rows this request's head pass needs), dropping
        older ones; None when some are missing (then it cannot draft until a recompute brings them)."""
        done, want = self._done.get(r.request_id, 0), len(r.token_ids) - 1
        pending = [f for f in self._pending[r.request_id] if f.end > done]
        self._pending[r.request_id] = pending
        if not pending or pending[0].start > done or pending[-1].end < want \
                or any(a.end != b.start for a, b in zip(pending, pending[1:], strict=False)):
            return None
        rows = mx.concatenate([f.rows for f in pending], axis=0) if len(pending) > 1 else pending[0].rows
        return rows[done - pending[0].start : want - pending[0].start]

    def _run(self, tokens: list[int], hidden: mx.array,
             chunks: list[tuple[int, int, list[int]]]) -> tuple[mx.array, mx.array]:
        meta = build_metadata(chunks, self.kv_cache.block_size)
        return self.head(mx.array(tokens, dtype=mx.int32), hidden, self.kv_cache, meta, self.attention_fn)

    def _choose(self, logits: mx.array) -> list[int]:
        return int_list(self.head.target_ids(mx.argmax(logits, axis=-1).astype(mx.int32)))
