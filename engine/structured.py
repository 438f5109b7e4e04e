"""Structured outputs: a request's `StructuredOutputs` compiled into an llguidance grammar, one matcher per
request, and the token masks of its logits rows (docs/structured-outputs.md)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.cpu import bitmask
from engine.sampling import StructuredOutputs

if TYPE_CHECKING:
    import llguidance

    from engine.request import Request
    from engine.step import SchedulerOutput

# llguidance is imported where used (~0.6 s to load): a server that never sees a grammar skips it.
MAX_CACHED_GRAMMARS = 256  # compiled prototype matchers kept (each request takes a copy)


class GrammarError(ValueError):
    """The request's schema, regex, choice list or grammar cannot be compiled (the message says why)."""


def grammar_source(spec: StructuredOutputs) -> str:
    """The llguidance grammar of `spec` (raises GrammarError for text llguidance cannot read)."""
    import llguidance

    fmt: llguidance.GrammarFormat
    if spec.json is not None or spec.json_object:
        fmt, text = "json_schema", spec.json if spec.json is not None else '{"type": "object"}'
        if spec.disable_any_whitespace:
            schema = json.loads(text)
            if isinstance(schema, dict):  # llguidance's own option, beside the schema's keywords
                schema["x-guidance"] = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
                text = json.dumps(schema)
    elif spec.regex is not None:
        fmt, text = "regex", spec.regex
    elif spec.choice is not None:
        fmt, text = "choice", json.dumps(list(spec.choice))
    else:
        assert spec.grammar is not None
        fmt, text = "grammar", spec.grammar
    try:
        return llguidance.grammar_from(fmt, text)
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self.words = (vocab_size + 31) // 32
        self._eos = eos_token_ids

    def masks(self, drafts: list[int]) -> np.ndarray:
        """[len(drafts) + 1, words] int32 bitmasks: the allowed tokens now and after each draft; the state is
        unchanged. Rows past a rejected draft allow nothing (never reached)."""
        import llguidance.numpy as lnp

        out = np.zeros((len(drafts) + 1, self.words), dtype=np.int32)
        lnp.fill_next_token_bitmask(self._m, out, 0)
        taken = 0
        for i, tok in enumerate(drafts):
            if self._m.try_consume_tokens([tok]) != 1:
                break
            taken += 1
            lnp.fill_next_token_bitmask(self._m, out, i + 1)
        if taken:
            self._m.rollback(taken)
        return out

    def mask_after(self, prefix: list[int]) -> np.ndarray:
        """[1, words]: the mask after `prefix`, all zeros where the grammar rejects it; state unchanged."""
        import llguidance.numpy as lnp

        out = np.zeros((1, self.words), dtype=np.int32)
        with self._after(prefix) as reached:
            if reached:
                lnp.fill_next_token_bitmask(self._m, out, 0)
        return out

    def allows_after(self, prefix: list[int], token: int) -> bool:
        """Whether the mask after `prefix` would keep `token`, without filling it. A False may be wrong
        (forced bytes' other spellings, end-of-sequence at the end): it only costs the caller a mask."""
        with self._after(prefix) as reached:
            if not reached:
                return False
            forced = self._m.compute_ff_tokens()
            return token == forced[0] if forced else self._m.validate_tokens([token]) == 1

    @contextmanager
    def _after(self, prefix: list[int]) -> Iterator[bool]:
        """The matcher in the state after `prefix` (True) or after its accepted part (False), rolled back
        after the block."""
        taken = int(self._m.try_consume_tokens(prefix)) if prefix else 0
        try:
            yield taken == len(prefix)
        finally:
            if taken:
                self._m.rollback(taken)

    def accept(self, tokens: list[int]) -> bool:
        """Advance past emitted tokens (False: one was not allowed). An ended grammar allows only
        end-of-sequence, which it does not consume."""
        n = 0 if self._m.is_stopped() else int(self._m.try_consume_tokens(tokens))
        rest = tokens[n:]
        return not self._m.is_error() and (not rest or (self._m.is_stopped()
                                                        and all(t in self._eos for t in rest)))

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows (nothing is consumed)."""
        return int(self._m.validate_tokens(drafts)) if drafts else 0

    def forced(self) -> list[int]:
        """Tokens the grammar allows alone, in order, from here (empty when there is a choice)."""
        return list(self._m.compute_ff_tokens())

    @property
    def stopped(self) -> bool:
        """The grammar allows nothing more (its end and the end-of-sequence token were consumed)."""
        return bool(self._m.is_stopped())


class GrammarRows:
    """One scheduled request's grammar over its logits rows this step (row i: the state after i drafts):
    every row's mask, or for argmax rows whether the argmax is allowed, a mask only where not."""

    __slots__ = ("_m", "drafts")

    def __init__(self, matcher: GrammarMatcher, drafts: list[int]) -> None:
        self._m = matcher
        self.drafts = drafts

    def masks(self) -> np.ndarray:
        """[len(drafts) + 1, words] int32 bits (GrammarMatcher.masks)."""
        return self._m.masks(self.drafts)

    def mask(self, i: int) -> np.ndarray:
        """[1, words]: row i's mask (drafts[:i] must be ones the grammar accepts)."""
        return self._m.mask_after(self.drafts[:i])

    def allows(self, i: int, token: int) -> bool:
        return self._m.allows_after(self.drafts[:i], token)


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A compiled grammar: requests each take a copy of the prototype matcher."""

    prototype: llguidance.LLMatcher
    vocab_size: int
    eos_token_ids: frozenset[int]

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.prototype.deep_copy(), self.vocab_size, self.eos_token_ids)


class GrammarCompiler:
    """Compiles `StructuredOutputs` against the tokenizer, with a bounded cache. Thread-safe (the server
    compiles on its preprocessing threads)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids) or None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, CompiledGrammar] = OrderedDict()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        # Built on first use (~0.4 s): servers that never see a grammar skip it.
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self._eos)
                bitmask.prepare()  # the mask kernel's one-off build, not in an engine step
            return self._tokenizer

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Raises GrammarError with llguidance's own account of what is wrong."""
        from llguidance import LLMatcher

        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        tokenizer = self._llg_tokenizer()
        source = grammar_source(spec)
        ok, problem = _validate(source, tokenizer)
        if not ok:
            raise GrammarError(problem)
        prototype = LLMatcher(tokenizer, source, log_level=0)
        if prototype.is_error():
            raise GrammarError(prototype.get_error())
        compiled = CompiledGrammar(prototype, self.vocab_size, frozenset(self._eos or ()))
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled


def _validate(source: str, tokenizer: llguidance.LLTokenizer) -> tuple[bool, str]:
    from llguidance import LLMatcher

    result = LLMatcher.validate_grammar(source, tokenizer)
    if isinstance(result, tuple):  # (ok, message) in some releases
        return bool(result[0]), str(result[1])
    return (not result), str(result)  # "" when valid, else the error text


class StructuredOutputManager:
    """The engine's matchers, one per constrained request, from add_request to its end."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.matchers: dict[str, GrammarMatcher] = {}

    def add(self, request_id: str, compiled: CompiledGrammar) -> None:
        self.matchers[request_id] = compiled.matcher()

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def attach(self, so: SchedulerOutput) -> None:
        """Give each scheduled constrained request with logits rows its grammar (before the runner runs)."""
        if not self.matchers:
            return
        for sr in so.scheduled:
            m = self.matchers.get(sr.request_id)
            if m is not None and sr.num_logits:
                sr.grammar = GrammarRows(m, sr.spec_token_ids[: sr.num_logits - 1])

    def accept(self, request_id: str, tokens: list[int]) -> bool:
        m = self.matchers.get(request_id)
        return m is None or m.accept(tokens)

    def fit_drafts(self, req: Request, limit: int, keep: bool) -> None:
        """Cut drafts at the first the grammar rejects; where it allows one continuation, draft that (at most
        `limit` tokens) unless `keep` (a probabilistic drafter holds their distributions)."""
        m = self.matchers.get(req.request_id)
        if m is None:
            return
        if req.spec_token_ids:
            del req.spec_token_ids[m.valid_prefix(req.spec_token_ids):]
        if limit > 0 and not keep:
            forced = m.forced()[:limit]
            if len(forced) > len(req.spec_token_ids):
                req.spec_token_ids[:] = forced
