"""Sampled draft verification: pure functions over probability arrays, numpy only.

The runner hands over the processed target rows (temperature, top-k/top-p/min-p and penalties already
applied) and the uniforms; nothing here draws randomness, so a step replays exactly from its uniforms.

Methods: `standard` (Leviathan et al. / Chen et al. rejection sampling, lossless), `block` (Sun et al.
2024, arXiv 2403.10444, Algorithm 2: lossless, accepts at least as many drafts in expectation),
`synthetic` (benchmarking only, lossy: a fixed acceptance rate) and `typical` (vLLM's old
TypicalAcceptanceSampler after Medusa section 3.3.1, lossy: an entropy-scaled probability threshold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

RejectionMethod = Literal["standard", "block", "synthetic", "typical"]
METHODS: tuple[str, ...] = ("standard", "block", "synthetic", "typical")
_CHUNK = 256  # inverse-CDF chunk width
_ENTROPY_EPS = 1e-5  # vLLM's typical acceptance takes log(p + 1e-5) so zero entries stay finite


@dataclass(frozen=True, slots=True)
class RejectionConfig:
    method: RejectionMethod = "standard"  # "strict" is an alias the config parser maps to "standard"
    synthetic_acceptance_rate: float | None = None  # method "synthetic" only, in [0, 1]
    posterior_threshold: float = 0.09  # method "typical" only (vLLM's defaults)
    posterior_alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown rejection method {self.method!r} (expected one of {METHODS})")
        rate = self.synthetic_acceptance_rate
        if self.method == "synthetic" and rate is None:
            raise ValueError("method 'synthetic' needs synthetic_acceptance_rate")
        if rate is not None and not 0.0 <= rate <= 1.0:
            raise ValueError(f"synthetic_acceptance_rate must be in [0, 1], got {rate}")
        if self.posterior_threshold < 0.0 or self.posterior_alpha < 0.0:
            raise ValueError("posterior_threshold and posterior_alpha must be >= 0")


def _search(cdf: np.ndarray, t: float, row: np.ndarray) -> int:
    """First index whose cumulative mass exceeds t (side="right" never lands on a zero entry: its
    cumulative sum equals the previous one, which would already exceed t); past the end (t rounded up
    to the total) it is the last entry with mass."""
    i = int(np.searchsorted(cdf, t, side="right"))
    return i if i < cdf.shape[0] else int(np.flatnonzero(row > 0)[-1])


def _inverse_cdf(row: np.ndarray, u: float) -> int:
    """Index drawn from the unnormalised non-negative `row` [V] with one uniform, or -1 if it has no mass.

    Two levels (chunk sums, then one chunk's cumsum): a full cumsum over V ~ 50k costs ~10x more."""
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
    i = _inverse_cdf(probs_row, u)
    if i < 0:
        raise ValueError("cannot sample from a row with no probability mass")
    return i


def _residual_or_target(residual: np.ndarray, target_row: np.ndarray, u: float) -> int:
    """Draw from the residual; one with no mass (p == q up to rounding) falls back to the target row."""
    i = _inverse_cdf(residual, u)
    return i if i >= 0 else sample_from(target_row, u)


def verify_sampled(draft_ids: list[int], p: np.ndarray, q: np.ndarray | None,
                   uniforms: np.ndarray, cfg: RejectionConfig) -> list[int]:
    """Tokens to append for one request: accepted drafts, then one correction or bonus token.

    draft_ids: K drafts. p: [K+1, V] target probs (row i: the distribution after the prefix plus
    draft_ids[:i]). q: [K, V] the drafter's probs for each draft, or None for deterministic drafts
    (q one-hot on the draft). uniforms: [K+1, 2] in [0, 1): column 0 for the accept test at position
    i, column 1 for the one categorical draw at position i. Returns 1..K+1 tokens."""
    d = [int(x) for x in draft_ids]
    k = len(d)
    if p.ndim != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must be [K+1, V] = [{k + 1}, V], got {p.shape}")
    if q is not None and q.shape != (k, p.shape[1]):
        raise ValueError(f"q must be [K, V] = [{k}, {p.shape[1]}], got {q.shape}")
    if uniforms.shape != (k + 1, 2):
        raise ValueError(f"uniforms must be [K+1, 2] = [{k + 1}, 2], got {uniforms.shape}")
    if k and not 0 <= min(d) <= max(d) < p.shape[1]:
        raise ValueError("draft id out of the vocabulary")
    if cfg.method == "standard":
        return _standard(d, p, q, uniforms)
    if cfg.method == "block":
        return _block(d, p, q, uniforms)
    if cfg.method == "synthetic":
        return _synthetic(d, p, uniforms, float(cfg.synthetic_acceptance_rate))
    return _typical(d, p, uniforms, cfg.posterior_threshold, cfg.posterior_alpha)


def _draft_probs(d: list[int], probs: np.ndarray | None) -> list[float]:
    """probs[i, d[i]] for each draft (1.0 for a one-hot q); K <= 8, so scalar reads beat a gather."""
    return [float(probs[i, x]) for i, x in enumerate(d)] if probs is not None else [1.0] * len(d)


def _standard(d: list[int], p: np.ndarray, q: np.ndarray | None, u: np.ndarray) -> list[int]:
    px, qx, u0 = _draft_probs(d, p), _draft_probs(d, q), u[:, 0].tolist()
    for i, x in enumerate(d):
        # u < min(1, p/q) without the division: q(x) = 0 accepts iff p(x) > 0, p(x) = 0 never accepts
        if u0[i] * qx[i] < px[i]:
            continue
        if q is None:  # max(p - onehot, 0): p without the rejected draft
            residual = p[i].copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p[i] - q[i], 0.0)  # [V]
        return [*d[:i], _residual_or_target(residual, p[i], float(u[i, 1]))]
    return [*d, sample_from(p[len(d)], float(u[len(d), 1]))]


def _block_residual(weight: float, p_row: np.ndarray, q: np.ndarray | None, i: int,
                    d: list[int]) -> np.ndarray:
    """max(weight * P - Q, 0) at 0-based row i, Q one-hot on d[i] when q is None."""
    r = p_row * weight  # [V]
    if q is None:
        r[d[i]] = max(r[d[i]] - 1.0, 0.0)
        return r
    r -= q[i]
    np.maximum(r, 0.0, out=r)
    return r


def _block(d: list[int], p: np.ndarray, q: np.ndarray | None, u: np.ndarray) -> list[int]:
    """Sun et al. Algorithm 2. Paper index i (1-based, i = 1..K) maps to 0-based rows as
    P_i = p[i-1], Q_i = q[i-1], eta_i = u[i-1, 0]; the residual after tau accepted drafts uses row tau."""
    k = len(d)
    px, qx, eta = _draft_probs(d, p), _draft_probs(d, q), u[:, 0].tolist()
    w = [1.0]  # w[i]: the paper's p_i, the weight of having accepted the first i drafts
    for i in range(k):
        if w[i] <= 0.0 or px[i] <= 0.0:
            w.append(0.0)
        elif qx[i] <= 0.0:  # cannot happen for a drawn draft; an infinite ratio saturates at 1
            w.append(1.0)
        else:
            w.append(min(w[i] * px[i] / qx[i], 1.0))
    # tau = the last i with eta_i <= h_i, so scan down from K and compute S_i only where needed.
    # `<` rather than `<=`: equal in measure, and h_i = 0 (an empty residual) can never be chosen.
    if k and eta[k - 1] < w[k]:  # h_K = p_K
        return [*d, sample_from(p[k], float(u[k, 1]))]
    for i in range(k - 1, 0, -1):
        if w[i] <= 0.0:
            continue
        residual = _block_residual(w[i], p[i], q, i, d)  # max(p_i P_{i+1} - Q_{i+1}, 0)
        s = float(residual.sum())
        if s > 0.0 and eta[i - 1] < s / (s + 1.0 - w[i]):
            return [*d[:i], _residual_or_target(residual, p[i], float(u[i, 1]))]
    if k == 0:
        return [sample_from(p[0], float(u[0, 1]))]
    return [_residual_or_target(_block_residual(1.0, p[0], q, 0, d), p[0], float(u[0, 1]))]


def _synthetic(d: list[int], p: np.ndarray, u: np.ndarray, rate: float) -> list[int]:
    u0 = u[:, 0].tolist()
    n = next((i for i in range(len(d)) if not u0[i] < rate), len(d))
    return [*d[:n], sample_from(p[n], float(u[n, 1]))]


def _typical(d: list[int], p: np.ndarray, u: np.ndarray, threshold: float, alpha: float) -> list[int]:
    """Accept while p_i(x) > min(threshold, alpha * exp(-H(p_i))); a rejection emits argmax p_i."""
    for i, x in enumerate(d):
        px = float(p[i, x])
        if px > threshold:  # above the cap: accepted whatever the entropy, skip the O(V) log
            continue
        row = p[i]
        entropy = -float((row * np.log(row + _ENTROPY_EPS)).sum())
        if px > min(threshold, alpha * math.exp(-entropy)):
            continue
        return [*d[:i], int(row.argmax())]
    return [*d, sample_from(p[len(d)], float(u[len(d), 1]))]
