"""The batched token sampler (parameters and records: `engine/sampling.py`).

Pipeline per step (mirrors vLLM v1's default order):

1. logprobs (if requested) = log_softmax of the logits *as given* (vLLM's default
   ``logprobs_mode="raw_logprobs"``: before min_tokens masking, penalties, temperature and filters);
2. min_tokens: EOS / stop_token_ids get -inf while ``len(output) < min_tokens``;
3. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
4. greedy rows (temperature < 1e-5): argmax of the processed logits, nothing else;
5. other rows: temperature, min_p, top_k, top_p, then an inverse-CDF draw with one uniform.

Seeded rows derive their uniform from ``(seed, len(output_token_ids))`` only, so their draws are
reproducible and do not depend on which other requests share the batch. Unseeded rows use a module-level
generator (``set_global_seed`` makes it deterministic).
"""

from __future__ import annotations

import secrets
import threading

import mlx.core as mx
import numpy as np

from engine.sampling import MASK64, RowState, SampleResult, SamplingParams, TokenLogprob
from engine.spec.rejection import sample_from

_TOP_CANDIDATES = 1024  # top-k/top-p look at this many best logits first


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


def _threshold(row: np.ndarray, top_k: int, top_p: float) -> float:
    """Smallest kept logit of one row (temperature-scaled) under top_k (0: none) then top_p; tokens tied
    with it are kept, like vLLM's top-k. Looks at the best _TOP_CANDIDATES logits first (a sort of the
    whole vocabulary is slow) and redoes the row whole when its nucleus is not closed within them."""
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
        c = vocab  # all candidates kept without top-k: the nucleus may go on


def filter_logits(x: mx.array | np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """Temperature, min_p, top_k, top_p (vLLM's order) for non-greedy rows.

    x: [n, vocab] processed logits -> [n, vocab] float32 scaled logits with -inf for every dropped token.
    NumPy, not MLX: on a 50k vocabulary MLX's CPU reductions cost several times NumPy's here."""
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
    """One token per row of x ([n, vocab] filtered logits): an inverse-CDF draw with one uniform, a
    seeded row's keyed by (seed, position) only, so it does not depend on the batch or the step."""
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
    tokens: list[int] = mx.argmax(x, axis=-1).tolist()  # final for greedy rows
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        random_state = [rows[i] for i in random_rows]
        filtered = filter_logits(x[mx.array(random_rows)], [r.params for r in random_state])
        for i, t in zip(random_rows, _draw(filtered, random_state), strict=True):
            tokens[i] = t
    return SampleResult(token_ids=tokens, logprobs=token_logprobs(logits, rows, tokens))


def target_probs(logits: mx.array, rows: list[RowState]) -> np.ndarray:
    """The distribution `sample` draws each row's token from: [num_rows, vocab] float32 probabilities
    (one-hot on the processed argmax for greedy rows). Rejection rules that compare the target with a
    drafter need it whole; `sample` itself never forms it."""
    x = process_logits(logits, rows)  # [n, vocab]
    probs = np.zeros(x.shape, dtype=np.float32)
    probs[np.arange(x.shape[0]), np.array(mx.argmax(x, axis=-1))] = 1.0
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        filtered = filter_logits(x[mx.array(random_rows)], [rows[i].params for i in random_rows])
        probs[random_rows] = _softmax(filtered)
    return probs


def row_uniforms(rows: list[RowState], stream: int) -> np.ndarray:
    """[num_rows, 2] uniforms in [0, 1) for the rejection rules (engine/spec/rejection.py). A seeded row's
    pair is keyed by (seed, its position, `stream`), like its sampling key: reproducible whatever the
    batch and the step; `stream` separates independent uses at one position (verification, drafting)."""
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
    """A probabilistic drafter's draw: one token per row of `logits` ([n, V], the drafter's own) from
    its processed distribution q (temperature, min_p, top_k, top_p as the request asks; no penalties),
    and q itself [n, V] float32, which the rejection rule needs. `positions`: each row's output position
    (a seeded row's draw is keyed by it, like its verification's). Rows must not be greedy."""
    q = _softmax(filter_logits(logits, params))  # [n, V]
    u = _uniforms([(p.seed, pos) for p, pos in zip(params, positions, strict=True)], DRAFT_STREAM)
    return [sample_from(q[i], float(u[i, 0])) for i in range(q.shape[0])], q
