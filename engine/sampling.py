"""Sampling parameters and the batched token sampler.

Pipeline per step (mirrors vLLM v1's default order):

1. logprobs (if requested) = log_softmax of the logits *as given* (vLLM's default
   ``logprobs_mode="raw_logprobs"``: before min_tokens masking, penalties, temperature and filters);
2. min_tokens: EOS / stop_token_ids get -inf while ``len(output) < min_tokens``;
3. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
4. greedy rows (temperature < 1e-5): argmax of the processed logits, nothing else;
5. other rows: temperature, min_p, top_k, top_p, then a Gumbel-max draw.

Seeded rows derive their key from ``(seed, len(output_token_ids))`` only, so their draws are reproducible
and do not depend on which other requests share the batch. Unseeded rows use a module-level key stream
(``set_global_seed`` makes it deterministic).
"""

from __future__ import annotations

import math
import secrets
import threading
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1000
MAX_CACHE_SALT_CHARS = 256
_TOP_CANDIDATES = 1024  # top-k/top-p look at this many best logits first
_MASK64 = (1 << 64) - 1


def _check_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _check_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the model's max length (engine decides)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k>=0: sampled token's logprob + top-k alternatives
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's per-request cache isolation: requests share prefix-cache blocks and suffix-tree content
    # only with requests of the same salt (None: the unsalted pool). Not a sampling option, but this is
    # the per-request record that travels with the request into the engine.
    cache_salt: str | None = None

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError (message starts with the offending field) for out-of-range values."""
        _check_finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        _check_finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(1 << 63) <= self.seed <= _MASK64:
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                             "characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids")
        for tok in self.stop_token_ids:
            _check_int("stop_token_ids", tok)
            if not 0 <= tok < vocab_size:
                raise ValueError(f"stop_token_ids entry {tok} is outside the vocabulary [0, {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def spec_decode_ok(self) -> bool:
        """True when the next token is exactly argmax of the raw logits at every position.

        top_k/top_p/min_p are ignored for greedy rows (they always keep the argmax), so they don't
        matter here; the seed is irrelevant too. min_tokens masks EOS depending on position, so rows
        that use it are excluded to keep draft verification a plain argmax.
        """
        return self.is_greedy and not self.has_penalties and self.logprobs is None and self.min_tokens == 0


@dataclass(slots=True)
class RowState:
    """One row of the logits to sample, built by the runner."""

    params: SamplingParams
    output_token_ids: list[int]  # generated so far: penalties, min_tokens, seeded key step
    prompt_token_ids: list[int]  # repetition_penalty covers prompt + output (as vLLM)
    eos_token_ids: list[int]  # banned (with stop_token_ids) while len(output) < min_tokens


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # k alternatives (id, logprob), descending


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


# ---------------------------------------------------------------------------------------------
# Random keys
# ---------------------------------------------------------------------------------------------

_key_lock = threading.Lock()
_global_key: mx.array = mx.random.key(secrets.randbits(64))


def set_global_seed(seed: int | None) -> None:
    """Seed the key stream used by unseeded rows (None: fresh OS entropy)."""
    global _global_key
    value = secrets.randbits(64) if seed is None else seed & _MASK64
    with _key_lock:
        _global_key = mx.random.key(value)
        # Evaluate now: a lazy key is tied to this thread's MLX stream, and another engine thread
        # splitting it later would fail ("There is no Stream(cpu, N) in current thread").
        mx.eval(_global_key)


def _next_global_key() -> mx.array:
    global _global_key
    with _key_lock:
        _global_key, sub = mx.random.split(_global_key)
        mx.eval(_global_key, sub)
    return sub


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_key(seed: int, step: int) -> mx.array:
    """Key for the `step`-th generated token of a request with this seed (no batch dependence)."""
    return mx.random.key(_splitmix64((seed & _MASK64) ^ _splitmix64(step)))


# ---------------------------------------------------------------------------------------------
# Logit processing
# ---------------------------------------------------------------------------------------------


def _unique_ids(ids: list[int], vocab: int) -> np.ndarray:
    """Sorted distinct in-vocab ids (a bool table beats np.unique on long prompts)."""
    arr = np.asarray(ids, dtype=np.int64)
    seen = np.zeros(vocab, dtype=bool)
    seen[arr[(arr >= 0) & (arr < vocab)]] = True
    return np.flatnonzero(seen)


def process_logits(logits: mx.array, rows: list[RowState]) -> mx.array:
    """min_tokens masking + penalties (the argmax-changing steps). Returns a new [num_rows, vocab] array.

    Sparse: only the (row, token) entries concerned are gathered, updated and scattered back, so the
    cost follows the number of distinct prompt/output tokens, not the vocabulary.
    """
    x = logits.astype(mx.float32)  # a new array object: the writes below never touch `logits`
    vocab = x.shape[1]
    # per update kind, one tuple of equal-length arrays per row: (row index, token id, values...)
    ban: list[tuple[np.ndarray, ...]] = []
    rep: list[tuple[np.ndarray, ...]] = []
    cnt: list[tuple[np.ndarray, ...]] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            ids = _unique_ids([*row.eos_token_ids, *p.stop_token_ids], vocab)
            ban.append((np.full(ids.size, i), ids))
        if p.repetition_penalty != 1.0:
            ids = _unique_ids([*row.prompt_token_ids, *row.output_token_ids], vocab)
            pen = np.full(ids.size, p.repetition_penalty, dtype=np.float32)
            rep.append((np.full(ids.size, i), ids, pen))
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_token_ids:
            out = np.asarray(row.output_token_ids, dtype=np.int64)
            ids, counts = np.unique(out[(out >= 0) & (out < vocab)], return_counts=True)
            freq = np.float32(p.frequency_penalty) * counts.astype(np.float32)
            pres = np.full(ids.size, p.presence_penalty, dtype=np.float32)
            cnt.append((np.full(ids.size, i), ids, freq, pres))

    def column(parts: list[tuple[np.ndarray, ...]], k: int) -> mx.array:
        return mx.array(np.concatenate([part[k] for part in parts]))  # [entries]

    if ban:
        x[column(ban, 0), column(ban, 1)] = -mx.inf
    if rep:
        r, t, pen = column(rep, 0), column(rep, 1), column(rep, 2)
        v = x[r, t]
        x[r, t] = mx.where(v > 0, v / pen, v * pen)
    if cnt:
        r, t = column(cnt, 0), column(cnt, 1)
        x[r, t] = x[r, t] - column(cnt, 2) - column(cnt, 3)  # as vLLM: -= freq * count, then -= presence
    return x


def _top_k_top_p_thresholds(x: mx.array, params: list[SamplingParams]) -> mx.array:
    """Smallest kept logit per row of x ([m, vocab], temperature-scaled) under top_k then top_p.

    Looks at the best _TOP_CANDIDATES logits only (a full-vocab sort is slow); rows whose nucleus is
    not closed within them (flat distributions, top_k above the cap) are redone over the whole vocab.
    Tokens tied with the threshold are kept, like vLLM's top-k.
    """
    m, vocab = x.shape
    top_k = np.array([p.top_k if 0 < p.top_k < vocab else 0 for p in params])  # 0: no top-k
    top_p = np.array([p.top_p if p.top_p < 1.0 else math.inf for p in params], dtype=np.float32)
    c = min(vocab, _TOP_CANDIDATES)
    thr, closed = _thresholds_within(x, top_k, top_p, c)
    if c < vocab:
        redo = np.flatnonzero(~closed | (top_k > c))
        if redo.size:
            full_thr, _ = _thresholds_within(x[mx.array(redo)], top_k[redo], top_p[redo], vocab)
            thr[mx.array(redo)] = full_thr
    return thr


def _thresholds_within(
    x: mx.array, top_k: np.ndarray, top_p: np.ndarray, c: int
) -> tuple[mx.array, np.ndarray]:
    """(threshold [m], closed [m]) using the c largest logits of each row; closed: exact answer."""
    m, vocab = x.shape
    cand = mx.topk(x, c, axis=-1) if c < vocab else x  # [m, c], unordered
    cand = mx.sort(cand, axis=-1)[:, ::-1]  # [m, c], descending
    rank = mx.arange(c)[None, :]  # [1, c]
    k = mx.array(np.where(top_k > 0, np.minimum(top_k, c), c))[:, None]  # [m, 1]
    in_k = rank < k  # [m, c]
    # top_p applies to the top-k survivors renormalised, or to the whole vocab without top-k
    log_z = mx.logsumexp(mx.where(in_k, cand, -mx.inf), axis=-1)  # [m]
    if c < vocab and (top_k == 0).any():
        log_z = mx.where(mx.array(top_k > 0), log_z, mx.logsumexp(x, axis=-1))
    probs = mx.where(in_k, mx.exp(cand - log_z[:, None]), 0.0)  # [m, c]
    mass_before = mx.cumsum(probs, axis=-1) - probs  # [m, c]
    keep = in_k & (mass_before < mx.array(top_p)[:, None])  # rank 0 always kept: 0 < top_p
    count = keep.astype(mx.int32).sum(axis=-1)  # [m], >= 1
    thr = mx.take_along_axis(cand, (count - 1)[:, None], axis=-1)[:, 0]  # [m]
    closed = np.array(count < c) | (top_k > 0)  # all c kept without top-k: the nucleus may go on
    return thr, closed


def filter_logits(x: mx.array, params: list[SamplingParams]) -> mx.array:
    """Temperature, min_p, top_k, top_p (vLLM's order) for non-greedy rows.

    x: [n, vocab] processed logits -> [n, vocab] scaled logits with -inf for every dropped token.
    """
    n, vocab = x.shape
    temp = mx.array([p.temperature for p in params], dtype=mx.float32)[:, None]  # [n, 1]
    x = x / temp
    neg_inf = mx.array(-mx.inf, dtype=mx.float32)

    if any(p.min_p > 0 for p in params):
        # p_i < min_p * p_max  <=>  x_i - x_max < log(min_p); log(0) = -inf masks nothing
        with np.errstate(divide="ignore"):
            log_min_p = mx.array(np.log(np.array([p.min_p for p in params], dtype=np.float32)))[:, None]
        x = mx.where(x - x.max(axis=-1, keepdims=True) < log_min_p, neg_inf, x)  # [n, vocab]

    restricted = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if restricted:
        idx = mx.array(restricted)
        thresholds = mx.full((n,), -mx.inf, dtype=mx.float32)  # [n]
        thresholds[idx] = _top_k_top_p_thresholds(x[idx], [params[j] for j in restricted])
        x = mx.where(x >= thresholds[:, None], x, neg_inf)  # [n, vocab]
    return x


def _draw(x: mx.array, rows: list[RowState]) -> mx.array:
    """One token per row of x ([n, vocab] filtered logits) -> [n] ids."""
    n, vocab = x.shape
    params = [r.params for r in rows]
    # Gumbel-max: argmax(x + g) ~ softmax(x). Seeded rows get their own noise row.
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    g = None
    if unseeded:
        g = mx.random.gumbel(shape=(len(unseeded), vocab), key=_next_global_key())  # [u, vocab]
    if len(unseeded) == n:
        noise = g
    else:
        noise_rows: list[mx.array] = []
        j = 0
        for row in rows:
            if row.params.seed is None:
                noise_rows.append(g[j])
                j += 1
            else:
                key = seeded_key(row.params.seed, len(row.output_token_ids))
                noise_rows.append(mx.random.gumbel(shape=(vocab,), key=key))  # [vocab]
        noise = mx.stack(noise_rows)  # [n, vocab]
    return mx.argmax(x + noise, axis=-1)  # [n]


def _logprobs(logits: mx.array, rows: list[RowState], tokens: list[int]) -> list[TokenLogprob | None]:
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if not want:
        return result
    idx = mx.array(want)
    raw = logits[idx].astype(mx.float32)  # [m, vocab]
    lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)  # [m, vocab]
    chosen = mx.take_along_axis(lp, mx.array([tokens[i] for i in want])[:, None], axis=-1)[:, 0]  # [m]
    k_max = max(rows[i].params.logprobs or 0 for i in want)
    top_ids = top_vals = None
    if k_max > 0:
        top_ids = mx.argpartition(-lp, kth=k_max - 1, axis=-1)[:, :k_max]  # [m, k_max], unordered
        top_vals = mx.take_along_axis(lp, top_ids, axis=-1)  # [m, k_max]
        mx.eval(chosen, top_ids, top_vals)
        top_ids, top_vals = top_ids.tolist(), top_vals.tolist()
    chosen_list = chosen.tolist()
    for j, i in enumerate(want):
        k = rows[i].params.logprobs or 0
        top: list[tuple[int, float]] = []
        if k > 0:
            pairs = sorted(zip(top_ids[j], top_vals[j], strict=True), key=lambda t: (-t[1], t[0]))
            top = [(int(t), float(v)) for t, v in pairs[:k]]
        result[i] = TokenLogprob(token_id=tokens[i], logprob=float(chosen_list[j]), top=top)
    return result


def sample(logits: mx.array, rows: list[RowState]) -> SampleResult:
    """Sample one token per row. logits: [num_rows, vocab] (float32; other dtypes are upcast)."""
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits shape {logits.shape} does not match {len(rows)} rows")
    if not rows:
        return SampleResult(token_ids=[], logprobs=[])
    x = process_logits(logits, rows)  # [num_rows, vocab]
    tokens = mx.argmax(x, axis=-1)  # [num_rows]; final for greedy rows
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        idx = mx.array(random_rows)
        random_state = [rows[i] for i in random_rows]
        filtered = filter_logits(x[idx], [r.params for r in random_state])  # [n_random, vocab]
        drawn = _draw(filtered, random_state)  # [n_random]
        tokens[idx] = drawn.astype(tokens.dtype)
    token_list: list[int] = tokens.tolist()
    return SampleResult(token_ids=token_list, logprobs=_logprobs(logits, rows, token_list))
