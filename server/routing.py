"""Prefix affinity for replicas: a request's prefix key (a chain of hashes over messages or prompt chunks,
as sent: the router holds no model), and which replica saw the longest prefix of it
(docs/scale-out.md). Pure Python: no Ray, no MLX."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any, TypeVar

R = TypeVar("R", bound=Hashable)  # a replica's id

CHARS_PER_LINK = 256
TOKENS_PER_LINK = 16
MAX_LINKS = 512  # a longer prompt's tail adds nothing to routing


def _encode(part: Any) -> bytes:
    return json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _link(parent: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(parent + data, digest_size=8).digest()


def route_key(path: str, body: Any) -> list[tuple[bytes, int]]:
    """(link hash, characters or tokens covered up to it) for an OpenAI request body; [] where there is
    nothing to key on (other routes, malformed bodies: the replica answers those)."""
    if not isinstance(body, dict):
        return []
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return []
        # Everything rendered before the first message: tools and a request's own template.
        root = _link(b"chat", _encode([body.get("model"), body.get("tools"), body.get("chat_template"),
                                       body.get("chat_template_kwargs")]))
        parts: Iterable[Any] = messages
    elif path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: key on its first prompt
        root = _link(b"completion", _encode(body.get("model")))
        if isinstance(prompt, str):
            parts = [prompt[i:i + CHARS_PER_LINK] for i in range(0, len(prompt), CHARS_PER_LINK)]
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            parts = [prompt[i:i + TOKENS_PER_LINK] for i in range(0, len(prompt), TOKENS_PER_LINK)]
        else:
            return []
    else:
        return []
    chain: list[tuple[bytes, int]] = []
    h, covered = root, 0
    for part in parts:
        if len(chain) == MAX_LINKS:
            break
        data = _encode(part)
        h = _link(h, data)
        covered += len(part) if isinstance(part, (str, list)) else len(data)
        chain.append((h, covered))
    return chain


class PrefixTable:
    """Which links each replica was sent, most recent last, at most `capacity` per replica (its prefix
    cache forgets too). A link stands for its whole chain, so a replica's match is its longest link."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._links: dict[Hashable, OrderedDict[bytes, None]] = {}

    def insert(self, replica: Hashable, chain: list[tuple[bytes, int]]) -> None:
        links = self._links.setdefault(replica, OrderedDict())
        for h, _ in chain:
            links[h] = None
            links.move_to_end(h)
        while len(links) > self.capacity:
            links.popitem(last=False)

    def match(self, replica: Hashable, chain: list[tuple[bytes, int]]) -> int:
        """Characters (or tokens) of `chain` the replica has seen."""
        links = self._links.get(replica)
        if not links:
            return 0
        for h, covered in reversed(chain):
            if h in links:
                return covered
        return 0

    def best(self, replicas: Iterable[R], chain: list[tuple[bytes, int]]) -> tuple[R | None, int]:
        best: R | None = None
        most = 0
        for r in replicas:
            m = self.match(r, chain)
            if m > most:
                best, most = r, m
        return best, most

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        alive = set(replicas)
        for r in [r for r in self._links if r not in alive]:
            del self._links[r]

    def drop(self, replica: Hashable) -> None:
        self._links.pop(replica, None)
