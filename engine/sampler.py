"""The batched token sampler (parameters and records: `engine/sampling.py`).

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

import mlx.core as mx
import numpy as np

from engine.sampling import MASK64, RowState, SampleResult, SamplingParams, TokenLogprob

_TOP_CANDIDATES = 1024  # top-k/top-p look at this many best logits first


# ---------------------------------------------------------------------------------------------
# Random keys
# ---------------------------------------------------------------------------------------------

_key_lock = threading.Lock()
_global_key: mx.array = mx.random.key(secrets.randbits(64))
_uniform_lock = threading.Lock()
_uniform_rng = np.random.default_rng(secrets.randbits(64))  # unseeded rows' rejection uniforms


def set_global_seed(seed: int | None) -> None:
    """Seed the key stream used by unseeded rows (None: fresh OS entropy)."""
    global _global_key, _uniform_rng
    value = secrets.randbits(64) if seed is None else seed & MASK64
    with _uniform_lock:
        _uniform_rng = np.random.default_rng(value)
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
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def seeded_key(seed: int, step: int) -> mx.array:
    """Key for the `step`-th generated token of a request with this seed (no batch dependence)."""
    return mx.random.key(_splitmix64((seed & MASK64) ^ _splitmix64(step)))


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


def token_logprobs(logits: mx.array, rows: list[RowState], tokens: list[int]) -> list[TokenLogprob | None]:
    """Per row that asked for logprobs: `tokens[i]`'s logprob under the raw logits and the top ones."""
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
    return SampleResult(token_ids=token_list, logprobs=token_logprobs(logits, rows, token_list))


def target_probs(logits: mx.array, rows: list[RowState]) -> mx.array:
    """The distribution `sample` draws each row's token from: [num_rows, vocab] float32 probabilities
    (one-hot on the processed argmax for greedy rows). Rejection rules that compare the target with a
    drafter need it whole; `sample` itself never forms it."""
    x = process_logits(logits, rows)  # [n, vocab]
    probs = (mx.arange(x.shape[1])[None, :] == mx.argmax(x, axis=-1)[:, None]).astype(mx.float32)
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        idx = mx.array(random_rows)
        filtered = filter_logits(x[idx], [rows[i].params for i in random_rows])  # [n_random, vocab]
        probs[idx] = mx.softmax(filtered, axis=-1)
    return probs


def row_uniforms(rows: list[RowState], stream: int) -> np.ndarray:
    """[num_rows, 2] uniforms in [0, 1) for the rejection rules (engine/spec/rejection.py). A seeded row's
    pair is keyed by (seed, its position, `stream`), like its sampling key: reproducible whatever the
    batch and the step; `stream` separates independent uses at one position (verification, drafting)."""
    out = np.empty((len(rows), 2))
    for i, row in enumerate(rows):
        seed = row.params.seed
        if seed is None:
            with _uniform_lock:
                out[i] = _uniform_rng.random(2)
        else:
            pos = len(row.output_token_ids)
            out[i] = np.random.default_rng([seed & MASK64, pos, stream]).random(2)
    return out
