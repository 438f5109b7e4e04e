"""Sampled draft verification, pure functions over processed probability rows and given uniforms: `standard`
(Leviathan et al.), `block` (Sun et al. 2024, arXiv 2403.10444, Algorithm 2), `synthetic` and `typical`
(vLLM's TypicalAcceptanceSampler). What each one guarantees: docs/speculative-decoding.md#sampled-requests."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from engine.sampler import inverse_cdf, sample_from

RejectionMethod = Literal["standard", "block", "synthetic", "typical"]
METHODS: tuple[str, ...] = get_args(RejectionMethod)
_ENTROPY_EPS = 1e-5  # vLLM's: log(p + eps) keeps zero entries finite


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


def _residual_or_target(residual: np.ndarray, target_row: np.ndarray, u: float) -> int:
    """Draw from the residual; one with no mass (p == q up to rounding) falls back to the target row."""
    i = inverse_cdf(residual, u)
    return i if i >= 0 else sample_from(target_row, u)


def verify_sampled(draft_ids: list[int], p: np.ndarray, q: np.ndarray | None,
                   uniforms: np.ndarray, cfg: RejectionConfig) -> list[int]:
    """Tokens to append for one request (1..K+1): accepted drafts, then a correction or bonus token.
    p: [K+1, V] target probs (row i: after draft_ids[:i]); q: [K, V] the drafter's, None for deterministic
    drafts; uniforms: [K+1, 2], column 0 for the accept test, column 1 for the categorical draw."""
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
        assert cfg.synthetic_acceptance_rate is not None  # __post_init__ requires it
        return _synthetic(d, p, uniforms, float(cfg.synthetic_acceptance_rate))
    return _typical(d, p, uniforms, cfg.posterior_threshold, cfg.posterior_alpha)


def _draft_probs(d: list[int], probs: np.ndarray | None) -> list[float]:
    """probs[i, d[i]] for each draft (1.0 for a one-hot q)."""
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
    """Sun et al. Algorithm 2; the paper's 1-based P_i, Q_i, eta_i are p[i-1], q[i-1], u[i-1, 0]."""
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
    # tau = the last i with eta_i <= h_i: scan down from K. `<` so that h_i = 0 is never chosen.
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
        if px > threshold:  # accepted whatever the entropy: skip the O(V) log
            continue
        row = p[i]
        entropy = -float((row * np.log(row + _ENTROPY_EPS)).sum())
        if px > min(threshold, alpha * math.exp(-entropy)):
            continue
        return [*d[:i], int(row.argmax())]
    return [*d, sample_from(p[len(d)], float(u[len(d), 1]))]
