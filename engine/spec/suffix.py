"""Suffix decoding (docs/speculative-decoding.md#methods): suffix tries over the request's own tokens and over
past responses, one cache per `cache_salt`, bounded by `max_cached_requests`."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from engine.spec.proposer import DraftRequest


@dataclass(slots=True)
class _Node:
    count: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


class SuffixTrie:
    """Counts of every substring of length <= depth of the inserted sequences."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Insert (sign=1) or remove (sign=-1) all substrings of `tokens` up to `depth` long."""
        d = self.depth
        for i in range(len(tokens)):
            node = self.root
            for tok in tokens[i : i + d]:
                child = node.children.get(tok)
                if child is None:
                    if sign < 0:
                        break
                    child = node.children[tok] = _Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[tok]
                    break
                node = child

    def extend(self, tokens: list[int], start: int) -> None:
        """The sequence grew from `start`: count the new substrings ending at each new token."""
        d = self.depth
        for end in range(start, len(tokens)):
            tok = tokens[end]
            for s in range(max(0, end - d + 1), end + 1):
                node = self.root
                for prev in tokens[s:end]:  # already inserted, so the path exists
                    node = node.children[prev]
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Node()
                child.count += 1

    def match(self, context: list[int]) -> tuple[_Node | None, int]:
        """Deepest node matching a suffix of `context` (longest match first)."""
        node: _Node | None
        for length in range(min(self.depth - 1, len(context)), 0, -1):
            node = self.root
            for tok in context[len(context) - length :]:
                node = node.children.get(tok)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0


def _follow(node: _Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """Greedy path of most frequent children -> (tokens, expected accepted = sum of path probs)."""
    out: list[int] = []
    prob, score = 1.0, 0.0
    while len(out) < max_tokens and node.children:
        total = sum(c.count for c in node.children.values())
        tok, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
        prob *= child.count / total
        if prob < min_prob:
            break
        out.append(tok)
        score += prob
        node = child
    return out, score


class SuffixProposer:
    drafts_before_choice = True  # a lookup
    filters_drafts = False
    shares_target_blocks = False

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.spec_factor = max_spec_factor
        self.min_prob = min_token_prob
        self._tries: dict[str | None, SuffixTrie] = {}  # cache_salt -> trie of its past responses
        # request -> (its cache_salt, output tokens), oldest first
        self._cached: OrderedDict[str, tuple[str | None, list[int]]] = OrderedDict()
        self._num_cached: dict[str | None, int] = {}  # cache_salt -> responses in its trie
        # request -> (trie, tokens inserted, its token list, prompt length, cache_salt)
        self._local: dict[str, tuple[SuffixTrie, int, list[int], int, str | None]] = {}

    def _local_trie(self, r: DraftRequest) -> SuffixTrie:
        entry = self._local.get(r.request_id)
        if entry is None:
            trie = SuffixTrie(self.depth + 1)
            trie.add(r.token_ids)
        else:
            trie, n = entry[0], entry[1]
            if n < len(r.token_ids):
                trie.extend(r.token_ids, n)
        self._local[r.request_id] = (trie, len(r.token_ids), r.token_ids, r.num_prompt_tokens, r.cache_salt)
        return trie

    def _draft(self, trie: SuffixTrie, context: list[int], k: int) -> tuple[list[int], float]:
        node, length = trie.match(context)
        if node is None:
            return [], 0.0
        limit = min(k, max(1, int(self.spec_factor * length)))
        return _follow(node, limit, self.min_prob)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            context = r.token_ids[-self.depth :]
            local = self._draft(self._local_trie(r), context, r.num_drafts)
            past = self._tries.get(r.cache_salt)
            glob = self._draft(past, context, r.num_drafts) if past is not None else ([], 0.0)
            out.append(max(local, glob, key=lambda d: d[1])[0])
        return out

    def catch_up_tokens(self, request: DraftRequest) -> int:
        return 0  # nothing to recompute before drafting

    def draft_probs(self) -> dict[str, np.ndarray]:
        return {}  # deterministic drafts

    def release(self, request_id: str, finished: bool) -> None:
        entry = self._local.pop(request_id, None)
        if finished and entry is not None:
            _, _, token_ids, num_prompt, salt = entry
            self.cache_response(request_id, token_ids[num_prompt:], salt)

    def cache_response(self, request_id: str, output_token_ids: list[int],
                       cache_salt: str | None = None) -> None:
        if self.max_cached == 0 or not output_token_ids:
            return
        tokens = list(output_token_ids)
        self._cached[request_id] = (cache_salt, tokens)
        trie = self._tries.get(cache_salt)
        if trie is None:
            trie = self._tries[cache_salt] = SuffixTrie(self.depth + 1)
        trie.add(tokens)
        self._num_cached[cache_salt] = self._num_cached.get(cache_salt, 0) + 1
        while len(self._cached) > self.max_cached:
            _, (salt, old) = self._cached.popitem(last=False)
            self._num_cached[salt] -= 1
            if self._num_cached[salt] == 0:  # a salt's last response takes its trie
                del self._num_cached[salt], self._tries[salt]
            else:
                self._tries[salt].add(old, sign=-1)
