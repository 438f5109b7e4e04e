"""The batched token sampler in vLLM v1's order (docs/architecture.md#the-engine-step); parameters and
records: `engine/sampling.py`."""

from __future__ import annotations

import secrets
import threading

import mlx.core as mx
import numpy as np

from engine.cpu.host import float_list, float_rows, int_list, int_rows
from engine.sampling import MASK64, RowState, SampleResult, SamplingParams, TokenLogprob

_TOP_CANDIDATES = 1024  # top-k/top-p look at this many best logits first
_CHUNK = 256  # inverse-CDF chunk width


def _search(cdf: np.ndarray, t: float, row: np.ndarray) -> int:
    """First index whose cumulative mass exceeds t (never a zero entry); past the end, the last with mass."""
    i = int(np.searchsorted(cdf, t, side="right"))
    return i if i < cdf.shape[0] else int(np.flatnonzero(row > 0)[-1])


def inverse_cdf(row: np.ndarray, u: float) -> int:
    """Index drawn from the unnormalised `row` [V] with one uniform (-1: no mass), by chunk sums first."""
    v = row.shape[0]
    if v <= 2 * _CHUNK:
        cdf = np.cumsum(row, dtype=np.float64)  # [V]
        return _search(cdf, u * cdf[-1], row) if cdf[-1] > 0.0 else -1
    full = v - v % _CHUNK
    sums = row[:full].reshape(-1, _CHUNK).sum(axis=1, dtype=np.float64)  # [V // CHUNK]
    if full < v:
        sums = np.append(sums, row[full:].sum(dtype=np.float64))
    ccdf = np.cumsum(sums)  # [num_chunks]
    if not ccdf[-1] > 0.0:
        return -1
    t = u * ccdf[-1]
    c = _search(ccdf, t, sums)
    seg = row[c * _CHUNK : (c + 1) * _CHUNK]
    before = ccdf[c - 1] if c else 0.0
    return c * _CHUNK + _search(np.cumsum(seg, dtype=np.float64), max(t - before, 0.0), seg)


def sample_from(probs_row: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from one probability row (need not sum to exactly 1); never a zero entry."""
    i = inverse_cdf(probs_row, u)
    if i < 0:
        raise ValueError("cannot sample from a row with no probability mass")
    return i


# ---------------------------------------------------------------------------------------------
# Random numbers
# ---------------------------------------------------------------------------------------------

_uniform_lock = threading.Lock()
_uniform_rng = np.random.default_rng(secrets.randbits(64))  # unseeded rows' uniforms

# row_uniforms' streams: independent uses of a seeded row's position
VERIFY_STREAM, DRAFT_STREAM, SAMPLE_STREAM = 0, 1, 2


def set_global_seed(seed: int | None) -> None:
    """Seed the stream used by unseeded rows (None: fresh OS entropy)."""
    global _uniform_rng
    value = secrets.randbits(64) if seed is None else seed & MASK64
    with _uniform_lock:
        _uniform_rng = np.random.default_rng(value)


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
    """min_tokens masking + penalties, sparse over the entries concerned -> a new [num_rows, vocab] array."""
    x = logits.astype(mx.float32)  # a new array: `logits` stays untouched
    vocab = x.shape[1]
    # per update kind and row: (row index, token id, values...) arrays of equal length
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
        r, t, penalty = column(rep, 0), column(rep, 1), column(rep, 2)
        v = x[r, t]
        x[r, t] = mx.where(v > 0, v / penalty, v * penalty)
    if cnt:
        r, t = column(cnt, 0), column(cnt, 1)
        x[r, t] = x[r, t] - column(cnt, 2) - column(cnt, 3)  # as vLLM
    return x


def _threshold(row: np.ndarray, top_k: int, top_p: float) -> float:
    """Smallest kept logit of one scaled row under top_k (0: none) then top_p, ties kept (as vLLM)."""
    vocab = row.shape[0]
    c = vocab if top_k > _TOP_CANDIDATES else min(vocab, _TOP_CANDIDATES)
    while True:
        cand = np.partition(row, vocab - c)[vocab - c :] if c < vocab else row
        cand = np.sort(cand)[::-1].astype(np.float64)  # [c], descending
        k = min(top_k, c) if top_k else c
        if top_p >= 1.0:
            return float(cand[k - 1])
        top = cand[:k]
        # top_p applies to the top-k survivors renormalised, or to the whole vocab without top-k
        e = np.exp(top - top[0])  # [k]
        probs = e / (e.sum() if top_k else np.exp(row - top[0]).sum(dtype=np.float64))
        mass_before = np.cumsum(probs) - probs  # non-decreasing: the kept tokens are a prefix
        count = max(1, int(np.count_nonzero(mass_before < top_p)))
        if count < c or top_k or c == vocab:
            return float(top[count - 1])
        c = vocab  # the nucleus may go on: the whole row


def filter_logits(x: mx.array | np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """Temperature, min_p, top_k, top_p (vLLM's order) in NumPy for non-greedy rows: [n, vocab] processed
    logits -> float32 scaled logits, -inf where dropped."""
    out = np.array(x, dtype=np.float32)  # a copy: [n, vocab]
    vocab = out.shape[1]
    out /= np.array([p.temperature for p in params], dtype=np.float32)[:, None]
    min_p = np.array([p.min_p for p in params], dtype=np.float32)
    if (min_p > 0).any():
        # p_i < min_p * p_max  <=>  x_i - x_max < log(min_p); log(0) = -inf masks nothing
        with np.errstate(divide="ignore"):
            log_min_p = np.log(min_p)[:, None]
        out[out - out.max(axis=1, keepdims=True) < log_min_p] = -np.inf
    for i, p in enumerate(params):
        if 0 < p.top_k < vocab or p.top_p < 1.0:
            row = out[i]
            row[row < _threshold(row, p.top_k if 0 < p.top_k < vocab else 0, p.top_p)] = -np.inf
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax of [n, vocab] filtered logits (-inf entries get 0)."""
    e = np.exp(x - x.max(axis=1, keepdims=True))
    e /= e.sum(axis=1, keepdims=True)
    return e


def _draw(x: np.ndarray, rows: list[RowState]) -> list[int]:
    """One token per row of x ([n, vocab] filtered logits)."""
    u = row_uniforms(rows, SAMPLE_STREAM)[:, 0]
    e = np.exp(x - x.max(axis=1, keepdims=True))  # [n, vocab], unnormalised; 0 for dropped tokens
    return [sample_from(e[i], float(u[i])) for i in range(len(rows))]


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
    top_id_rows: list[list[int]] = []
    top_val_rows: list[list[float]] = []
    if k_max > 0:
        top_ids = mx.argpartition(-lp, kth=k_max - 1, axis=-1)[:, :k_max]  # [m, k_max], unordered
        top_vals = mx.take_along_axis(lp, top_ids, axis=-1)  # [m, k_max]
        mx.eval(chosen, top_ids, top_vals)
        top_id_rows, top_val_rows = int_rows(top_ids), float_rows(top_vals)
    chosen_list = float_list(chosen)
    for j, i in enumerate(want):
        k = rows[i].params.logprobs or 0
        top: list[tuple[int, float]] = []
        if k > 0:
            pairs = sorted(zip(top_id_rows[j], top_val_rows[j], strict=True), key=lambda t: (-t[1], t[0]))
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
    tokens = int_list(mx.argmax(x, axis=-1))  # final for greedy rows
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        random_state = [rows[i] for i in random_rows]
        filtered = filter_logits(x[mx.array(random_rows)], [r.params for r in random_state])
        for i, t in zip(random_rows, _draw(filtered, random_state), strict=True):
            tokens[i] = t
    return SampleResult(token_ids=tokens, logprobs=token_logprobs(logits, rows, tokens))


def target_probs(logits: mx.array, rows: list[RowState]) -> np.ndarray:
    """The distribution `sample` draws from, [num_rows, vocab] (one-hot for greedy rows)."""
    x = process_logits(logits, rows)  # [n, vocab]
    probs = np.zeros(x.shape, dtype=np.float32)
    probs[np.arange(x.shape[0]), np.array(mx.argmax(x, axis=-1))] = 1.0
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        filtered = filter_logits(x[mx.array(random_rows)], [rows[i].params for i in random_rows])
        probs[random_rows] = _softmax(filtered)
    return probs


def row_uniforms(rows: list[RowState], stream: int) -> np.ndarray:
    """[num_rows, 2] uniforms for the rejection rules, seeded rows keyed by (seed, position, `stream`)."""
    return _uniforms([(row.params.seed, len(row.output_token_ids)) for row in rows], stream)


def _uniforms(keys: list[tuple[int | None, int]], stream: int) -> np.ndarray:
    """[n, 2] uniforms for (seed or None, output position) pairs: seeded ones keyed, the rest drawn."""
    out = np.empty((len(keys), 2))
    for i, (seed, pos) in enumerate(keys):
        if seed is None:
            with _uniform_lock:
                out[i] = _uniform_rng.random(2)
        else:
            out[i] = np.random.default_rng([seed & MASK64, pos, stream]).random(2)
    return out


def draft_sample(logits: mx.array, params: list[SamplingParams], positions: list[int],
                 ) -> tuple[list[int], np.ndarray]:
    """A probabilistic drafter's draws from its filtered q (no penalties) -> (tokens, q [n, V]); `positions`
    key seeded rows."""
    q = _softmax(filter_logits(logits, params))  # [n, V]
    u = _uniforms([(p.seed, pos) for p, pos in zip(params, positions, strict=True)], DRAFT_STREAM)
    return [sample_from(q[i], float(u[i, 0])) for i in range(q.shape[0])], q
