"""Incremental detokenization (a sliding window of ids) and stop strings (an Aho-Corasick automaton); how
both work: docs/architecture.md#the-engine-step."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from engine.sampling import SamplingParams

_REPLACEMENT = "\ufffd"
# Tokens behind an incomplete character before looking for an earlier boundary (a UTF-8 tail spans <= 3).
_MAX_PENDING = 6
# Bytes of built stop automata kept for reuse.
STOP_MATCHER_CACHE_BYTES = 32 * 2**20
# Per node beyond its dict: fail/depth/match_len ints and the key string (errs high).
_NODE_EXTRA_BYTES = 128


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(slots=True)
class StopMatcher:
    """Aho-Corasick automaton over a set of stop strings."""

    goto: list[dict[str, int]]  # per node: char -> child node
    fail: list[int]  # per node: longest proper suffix that is also a node
    depth: list[int]  # per node: length of its path from the root
    match_len: list[int]  # per node: longest stop string that is a suffix of its path (0: none)
    nbytes: int = 0  # approximate memory held: what the cache is bounded by

    @classmethod
    def build(cls, stops: tuple[str, ...]) -> StopMatcher:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal = [False]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    terminal.append(False)
                node = nxt
            terminal[node] = True
        fail = [0] * len(goto)
        match_len = [0] * len(goto)
        queue = list(goto[0].values())  # BFS: a node's fail target is always shallower
        for v in queue:
            match_len[v] = depth[v] if terminal[v] else 0
        head = 0
        while head < len(queue):
            u = queue[head]
            head += 1
            for ch, v in goto[u].items():
                f = fail[u]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[v] = goto[f].get(ch, 0)
                match_len[v] = depth[v] if terminal[v] else match_len[fail[v]]
                queue.append(v)
        nbytes = (sum(map(sys.getsizeof, goto)) + len(goto) * _NODE_EXTRA_BYTES
                  + sum(sys.getsizeof(x) for x in (goto, fail, depth, match_len)))
        return cls(goto=goto, fail=fail, depth=depth, match_len=match_len, nbytes=nbytes)

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


class StopMatcherCache:
    """Least-recently-used automata by stop list within a byte bound (thread-safe)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[tuple[str, ...], tuple[StopMatcher, int]] = OrderedDict()  # (matcher, cost)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, stops: tuple[str, ...]) -> StopMatcher:
        with self._lock:
            item = self._items.get(stops)
            if item is not None:
                self._items.move_to_end(stops)
                return item[0]
        matcher = StopMatcher.build(stops)  # outside the lock: builds may run in parallel
        cost = matcher.nbytes + sum(map(sys.getsizeof, stops))
        if cost > self.max_bytes:
            return matcher
        with self._lock:
            if stops not in self._items:
                self._items[stops] = (matcher, cost)
                self.nbytes += cost
                while self.nbytes > self.max_bytes:
                    self.nbytes -= self._items.popitem(last=False)[1][1]
        return matcher


_CACHE = StopMatcherCache(STOP_MATCHER_CACHE_BYTES)


def stop_matcher(stops: Iterable[str], cache: StopMatcherCache | None = _CACHE) -> StopMatcher | None:
    """The automaton for a request's stop strings (None: none); O(total length) on a cache miss."""
    key = tuple(dict.fromkeys(s for s in stops if s))  # dedupe, keep order
    if not key:
        return None
    return cache.get(key) if cache is not None else StopMatcher.build(key)


def _trailing_replacements(text: str) -> int:
    return len(text) - len(text.rstrip(_REPLACEMENT))


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens (`tokenizer.decode(output_ids)`), holding back what
    may still change."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 matcher: StopMatcher | None = None) -> None:
        """`matcher`: `stop_matcher(params.stop)` built beforehand (None: built here)."""
        del prompt_token_ids  # not decoding context
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._matcher = matcher if matcher is not None else stop_matcher(params.stop)
        self._ids: list[int] = []
        # decode window: ids[prefix_offset:read_offset] is already-decoded context of length prefix_len
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_len = 0
        self._read_pos = 0  # position in the output text where ids[read_offset:] starts
        self._decoded = 0  # characters handed to the stop stage so far
        self._state = 0  # stop automaton state
        self._held = ""  # decoded, not yet emitted: a possible stop-string prefix
        self._chunks: list[str] = []
        self._text: str | None = ""
        self._stop: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """Full emitted output text so far."""
        if self._text is None:
            self._text = "".join(self._chunks)
            self._chunks = [self._text]
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._stop

    @property
    def finished(self) -> bool:
        return self._finished

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Add generated tokens; return (text safe to emit now, matched stop string or None)."""
        if self._finished:
            return "", None
        emitted: list[str] = []
        for token_id in token_ids:
            self._ids.append(token_id)
            new = self._decode_new(force=False)
            if new and self._scan(new, emitted):
                break
        return "".join(emitted), self._stop

    def flush(self) -> str:
        """Finish (length / EOS): release everything held back, incomplete characters included."""
        if self._finished:
            return ""
        emitted: list[str] = []
        new = self._decode_new(force=True)
        if not (new and self._scan(new, emitted)) and self._held:
            self._emit(self._held, emitted)
            self._held = ""
        self._finished = True
        return "".join(emitted)

    # -- decoding -------------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _decode_new(self, force: bool) -> str:
        """Newly decoded, stable text since the last call; slides the window when it can."""
        full = self._decode(self._ids[self._prefix_offset :])
        # trailing U+FFFD may be an incomplete character that the next token completes: hold it back
        incomplete = 0 if force else _trailing_replacements(full)
        end = len(full) - incomplete
        boundary = None
        if incomplete and len(self._ids) - self._read_offset > _MAX_PENDING:
            boundary = self._find_boundary(full)
            if boundary is not None:
                end = max(end, boundary[1])  # text before a clean boundary is final
        start = self._prefix_len + self._decoded - self._read_pos
        new = full[start:end] if end > start else ""
        self._decoded += len(new)
        if not incomplete:
            self._slide(len(self._ids), len(full))
        elif boundary is not None:
            self._slide(*boundary)
        return new

    def _find_boundary(self, full: str) -> tuple[int, int] | None:
        """Text keeps ending in U+FFFD: the latest recent token boundary j no character straddles, as
        (j, len(decode(ids[prefix:j])))."""
        ids = self._ids
        for j in range(len(ids) - 1, max(self._read_offset, len(ids) - 1 - _MAX_PENDING), -1):
            head = self._decode(ids[self._prefix_offset : j])
            if not head.endswith(_REPLACEMENT) or head + self._decode(ids[j:]) == full:
                return j, len(head)
        return None

    def _slide(self, new_read: int, window_len: int) -> None:
        """Move read_offset to new_read; window_len = len(decode(ids[prefix_offset:new_read]))."""
        self._read_pos += window_len - self._prefix_len
        self._prefix_offset, self._read_offset = self._read_offset, new_read
        self._prefix_len = len(self._decode(self._ids[self._prefix_offset : new_read]))

    # -- stop strings -----------------------------------------------------------------------------

    def _emit(self, text: str, out: list[str]) -> None:
        if text:
            out.append(text)
            self._chunks.append(text)
            self._text = None

    def _scan(self, new: str, out: list[str]) -> bool:
        """Feed new text to the stop matcher, emit what is safe; True when a stop string matched."""
        matcher = self._matcher
        if matcher is None:
            self._emit(new, out)
            return False
        check = len(self._ids) > self._min_tokens
        buf = self._held + new
        base = len(self._held)
        state = self._state
        step, match_len = matcher.step, matcher.match_len
        for i, ch in enumerate(new):
            state = step(state, ch)
            if check and match_len[state]:
                end = base + i + 1
                start = end - match_len[state]  # >= 0: the held suffix covers any partial match
                self._stop = buf[start:end]
                self._emit(buf[:end] if self._include_stop else buf[:start], out)
                self._held = ""
                self._finished = True
                return True
        self._state = state
        keep = matcher.depth[state]  # longest suffix that may still grow into a stop string
        self._emit(buf[: len(buf) - keep], out)
        self._held = buf[len(buf) - keep :]
        return False
