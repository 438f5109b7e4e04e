"""A small model drafts K tokens over its own paged KV cache, out of the target's memory budget. Rollback is
by position; when the pool is short, the requests drafted for longest ago give their blocks back."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.attention.reference import paged_attention_reference
from engine.attention.selector import cpu_attention_fits
from engine.cpu.attention import cpu_paged_attention
from engine.cpu.layers import build_stack
from engine.kv.block_manager import KVCacheManager
from engine.kv.cache import PagedKVCache
from engine.models import adapter
from engine.models.loader import LoadedModel
from engine.models.weights import int8_products
from engine.runner import ModelRunner
from engine.spec.draft_sampling import DraftDraws, samples
from engine.spec.proposer import DraftRequest

logger = logging.getLogger(__name__)


class DraftModelError(ValueError):
    pass


def check_draft_compatible(target: LoadedModel, draft: LoadedModel, key: str = "model") -> None:
    """Start-up checks: same vocabulary and tokenizer, no sliding-window layers."""
    if draft.vocab_size != target.vocab_size:
        raise DraftModelError(f"invalid --speculative-config: {key}: draft vocabulary size "
                              f"{draft.vocab_size} differs from the target's {target.vocab_size}")
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise DraftModelError(f"invalid --speculative-config: {key}: the draft's tokenizer differs from the "
                              "target's (token ids must mean the same text)")
    windows = adapter.layer_windows(draft.model)
    if any(w is not None for w in windows):
        raise DraftModelError(f"invalid --speculative-config: {key}: sliding-window draft models are not "
                              "supported")


@dataclass(slots=True)
class _State:
    start: int  # len(token_ids) when the last proposal was made
    fed: list[int]  # drafts fed to the draft model after the last confirmed token


class DraftModelProposer:
    drafts_before_choice = False  # each draft token costs a forward: K is chosen first
    filters_drafts = False
    shares_target_blocks = False

    def __init__(self, draft: LoadedModel, num_blocks: int, block_size: int,
                 attention_fn: Callable[..., mx.array] = paged_attention_reference,
                 probabilistic: bool = False) -> None:
        """`attention_fn`: the target's attention backend (the reference path where the C kernel cannot read
        the draft's cache). `probabilistic`: sampled requests' drafts are drawn, not the argmax."""
        model = draft.model
        self.probabilistic = probabilistic
        self.vocab_size = draft.vocab_size
        self._probs: dict[str, np.ndarray] = {}
        layout = adapter.kv_layout(model)
        self.kv_cache = PagedKVCache(layout.shapes, num_blocks, block_size, draft.dtype)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        if attention_fn is cpu_paged_attention and cpu_attention_fits(self.kv_cache) is not None:
            attention_fn = paged_attention_reference
        # The draft's decoder layers in C where they apply.
        stack, _ = build_stack(model, self.kv_cache, layout.windows, attention_fn is cpu_paged_attention,
                               draft.config, act_int8=int8_products(model))
        self.runner = ModelRunner(model, self.kv_cache, attention_fn, stack=stack)
        self._state: dict[str, _State] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()  # requests holding draft KV, oldest first
        self.num_evictions = 0

    @staticmethod
    def bytes_per_block(draft: LoadedModel, block_size: int) -> int:
        return PagedKVCache.bytes_per_block(adapter.kv_layout(draft.model).shapes, block_size, draft.dtype)

    def _num_valid(self, rid: str, token_ids: list[int]) -> int:
        """Leading draft positions whose KV still matches the confirmed tokens."""
        st = self._state.get(rid)
        if st is None:
            return 0
        j = 0
        while j < len(st.fed) and st.start + j < len(token_ids) and token_ids[st.start + j] == st.fed[j]:
            j += 1
        return min(st.start + j, len(token_ids) - 1)

    def catch_up_tokens(self, request: DraftRequest) -> int:
        return len(request.token_ids) - self._num_valid(request.request_id, request.token_ids)

    def draft_probs(self) -> dict[str, np.ndarray]:
        return self._probs

    def _tokens(self, h: mx.array, reqs: list[DraftRequest], step: int, draws: DraftDraws) -> list[int]:
        """The next draft per row of h: the argmax, or a draw for requests that sample."""
        drawn = [samples(r, self.probabilistic) for r in reqs]
        if not any(drawn):
            return self.runner.greedy_tokens(h)
        return draws.choose(adapter.compute_logits(self.runner.model, h), reqs, step, drawn)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        self._probs = {}
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[tuple[int, DraftRequest, int]] = []  # (index, request, first position to feed)
        keep = {r.request_id for r in requests}
        for i, r in enumerate(requests):
            c = self._num_valid(r.request_id, r.token_ids)
            if self._allocate(r, c, keep):
                active.append((i, r, c))
                self._recent[r.request_id] = None
                self._recent.move_to_end(r.request_id)
            else:
                self._state.pop(r.request_id, None)
        if not active:
            return drafts
        draws = DraftDraws(self.vocab_size)
        chunks = [(r.token_ids[c:], c, self.kv.block_table(r.request_id), 1) for _, r, c in active]
        toks = self._tokens(self.runner.forward_chunks(chunks), [r for _, r, _ in active], 0, draws)
        for (i, _, _), t in zip(active, toks, strict=True):
            drafts[i].append(t)
        step = 1
        while True:
            live = [(i, r) for i, r, _ in active if r.num_drafts > step]
            if not live:
                break
            chunks = [([drafts[i][-1]], len(r.token_ids) + step - 1, self.kv.block_table(r.request_id), 1)
                      for i, r in live]
            toks = self._tokens(self.runner.forward_chunks(chunks), [r for _, r in live], step, draws)
            for (i, _), t in zip(live, toks, strict=True):
                drafts[i].append(t)
            step += 1
        for i, r, _ in active:
            self._state[r.request_id] = _State(start=len(r.token_ids), fed=drafts[i][:-1])
        self._probs = draws.result({r.request_id: len(drafts[i]) for i, r, _ in active})
        return drafts

    def _allocate(self, r: DraftRequest, c: int, keep: set[str]) -> bool:
        """Slots for the unfed confirmed tokens and the K-1 drafts fed back; when the pool is short, the least
        recently drafted request outside this call gives its blocks back."""
        n = len(r.token_ids)
        while not self.kv.allocate_slots(r.request_id, c, n - c + r.num_drafts - 1):
            victim = next((rid for rid in self._recent if rid not in keep), None)
            if victim is None:
                return False
            self.release(victim, finished=False)
            self.num_evictions += 1
        return True

    def release(self, request_id: str, finished: bool) -> None:
        self._state.pop(request_id, None)
        self._recent.pop(request_id, None)
        self.kv.free(request_id)
