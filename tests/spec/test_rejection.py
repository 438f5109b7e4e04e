"""Sampled verification (engine/spec/rejection.py): the lossless methods reproduce the target's
distribution (chi-square over 100k verifications), broken variants are caught by the same check,
block beats standard on acceptance, and the lossy methods do what they say."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import pytest

from engine.sampler import sample_from
from engine.spec.rejection import RejectionConfig, verify_sampled
from engine.spec.verify import accept_matching
from tests.helpers import chi2_sf

V = 6  # tiny vocabulary: every trial calls verify_sampled, so the per-call cost sets the runtime
TRIALS = 100_000
START = 0  # the token before the first draft
FIXED = 2  # the deterministic drafter's token
Verifier = Callable[[list[int], np.ndarray, "np.ndarray | None", np.ndarray], list[int]]


# ---- chi-square without scipy (tests/helpers.py: chi2_sf) ------------------------------------

def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of counts to probs (flattened). A count in a zero-probability cell is p = 0;
    cells expected below 5 are pooled."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum() / probs.sum()
    big, small = expected >= 5, (probs > 0) & (expected < 5)
    obs, exp = list(counts[big]), list(expected[big])
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    obs_a, exp_a = np.array(obs), np.array(exp)
    return chi2_sf(float(((obs_a - exp_a) ** 2 / exp_a).sum()), len(obs) - 1)


def test_chi2_sf_matches_closed_forms():
    for x in (0.1, 1.0, 3.0, 10.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-10)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(124.342, 100) == pytest.approx(0.05, rel=1e-3)


# ---- scenarios: target P and drafter Q as tables [position, previous token, V] ---------------------

def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """Zero all but the k largest of each row (what the runner's top-k leaves) and renormalise."""
    cut = np.sort(probs, axis=-1)[..., -k][..., None]
    kept = np.where(probs >= cut, probs, 0.0)
    return kept / kept.sum(axis=-1, keepdims=True)


@functools.cache
def scenario(name: str, positions: int) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(P, Q, drafts) with P, Q: [positions, V, V] (row = distribution given position and previous
    token) and drafts: "q" (sampled from Q, verified against Q), "q-onehot" (sampled from Q, verified
    as deterministic drafts) or "fixed" (always FIXED, verified as deterministic drafts)."""
    rng = np.random.default_rng(sum(map(ord, name)))
    shape = (positions, V, V)

    def logits(scale: float) -> np.ndarray:
        return scale * rng.standard_normal(shape)

    if name == "peaked":  # a top-4 target: two zero entries per row
        return _top_k(_softmax(logits(2.5)), 4), _softmax(logits(2.5)), "q"
    if name == "flat":
        return _softmax(logits(0.3)), _softmax(logits(0.3)), "q"
    if name == "disjoint":  # every draft rejected: the output is the residual, i.e. P itself
        p, q = _softmax(logits(1.0)), _softmax(logits(1.0))
        p[..., 3:] = 0.0
        q[..., :3] = 0.0
        return p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True), "q"
    if name == "equal":  # p == q: every draft accepted
        p = _softmax(logits(1.5))
        return p, p.copy(), "q"
    if name == "onehot-fixed":
        return _softmax(logits(1.5)), None, "fixed"
    if name == "onehot-from-q":
        return _softmax(logits(1.5)), _softmax(logits(1.5)), "q-onehot"
    if name == "two-token":  # iid rows P = (1/3, 2/3), Q = (2/3, 1/3): block strictly beats standard
        p, q = np.zeros(shape), np.zeros(shape)
        p[..., :2] = [1 / 3, 2 / 3]
        q[..., :2] = [2 / 3, 1 / 3]
        return p, q, "q"
    raise KeyError(name)


def _draw(rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One categorical draw per row of [N, V]."""
    cdf = np.cumsum(rows, axis=-1)
    idx = (cdf < rng.random((rows.shape[0], 1)) * cdf[:, -1:]).sum(axis=-1)
    return np.minimum(idx, rows.shape[1] - 1)


@functools.cache
def simulate(name: str, k: int, verifier_name: str, trials: int = TRIALS, seed: int = 0):
    """Run `trials` independent verifications of K drafts. Returns (first [N], second [N], accepted [N]):
    the first two tokens of the continuation (the second drawn from the target when one verification
    emitted a single token, as the next step would) and the number of drafts accepted."""
    verifier = VERIFIERS[verifier_name]
    table_p, table_q, mode = scenario(name, k + 1)
    rng = np.random.default_rng(seed)
    prev = np.full((trials, k + 1), START)  # [N, K+1]: the token before each position
    drafts = np.full((trials, k), FIXED)  # [N, K]
    for t in range(k):
        if mode != "fixed":  # drafts sampled autoregressively from the drafter's table
            drafts[:, t] = _draw(table_q[t, prev[:, t]], rng)
        prev[:, t + 1] = drafts[:, t]
    pos = np.arange(k + 1)
    p_all = table_p[pos, prev]  # [N, K+1, V]
    q_all = table_q[pos[:k], prev[:, :k]] if mode == "q" else None  # [N, K, V]
    uniforms = rng.random((trials, k + 1, 2))
    draft_lists = drafts.tolist()
    first = np.empty(trials, dtype=np.int64)
    second = np.full(trials, -1, dtype=np.int64)
    accepted = np.empty(trials, dtype=np.int64)
    for n in range(trials):
        out = verifier(draft_lists[n], p_all[n], None if q_all is None else q_all[n], uniforms[n])
        first[n] = out[0]
        if len(out) > 1:
            second[n] = out[1]
        accepted[n] = len(out) - 1
    short = second < 0
    second[short] = _draw(table_p[1, first[short]], rng)
    return first, second, accepted


def target_marginals(name: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact target law of the first token [V] and of the first two tokens [V, V]."""
    table_p = scenario(name, k + 1)[0]
    p1 = table_p[0, START]
    return p1, p1[:, None] * table_p[1]


def fit_pvalues(name: str, k: int, verifier_name: str, trials: int = TRIALS) -> tuple[float, float]:
    first, second, _ = simulate(name, k, verifier_name, trials)
    p1, p12 = target_marginals(name, k)
    joint = np.zeros((V, V))
    np.add.at(joint, (first, second), 1)
    return chi2_pvalue(np.bincount(first, minlength=V), p1), chi2_pvalue(joint, p12)


# ---- verifiers: the module's and two broken ones the check must catch -----------------------------

def _method(method: str) -> Verifier:
    cfg = RejectionConfig(method=method)
    return lambda d, p, q, u: verify_sampled(d, p, q, u, cfg)


def _broken_standard(d: list[int], p: np.ndarray, q: np.ndarray | None, u: np.ndarray, *,
                     ratio_inverted: bool = False, renormalise: bool = True) -> list[int]:
    """Standard rejection sampling with one deliberate fault."""
    for i, x in enumerate(d):
        px, qx = p[i, x], (q[i, x] if q is not None else 1.0)
        num, den = (qx, px) if ratio_inverted else (px, qx)
        ratio = num / den if den > 0 else math.inf
        if u[i, 0] < min(1.0, ratio):
            continue
        onehot = np.eye(p.shape[1])[x]
        residual = np.maximum(p[i] - (q[i] if q is not None else onehot), 0.0) if renormalise else p[i]
        return [*d[:i], sample_from(residual if residual.sum() > 0 else p[i], u[i, 1])]
    return [*d, sample_from(p[len(d)], u[len(d), 1])]


VERIFIERS: dict[str, Verifier] = {
    "standard": _method("standard"),
    "block": _method("block"),
    "residual-is-p": functools.partial(_broken_standard, renormalise=False),
    "ratio-q-over-p": functools.partial(_broken_standard, ratio_inverted=True),
}

SCENARIOS = ["peaked", "flat", "disjoint", "equal", "onehot-fixed", "onehot-from-q"]
# 100k verifications cost ~1 s each here, so the default run keeps 11 of the 24 cases: every scenario
# once, weighted to block with K=3 (block with K=1 is standard's rule); -m slow runs the rest.
DEFAULT = {("standard", 1, "peaked"), ("standard", 1, "onehot-fixed"),
           *(("standard", 3, s) for s in ("flat", "disjoint", "equal", "onehot-from-q")),
           ("block", 1, "onehot-from-q"),
           *(("block", 3, s) for s in ("peaked", "flat", "onehot-fixed", "onehot-from-q"))}
CASES = [pytest.param(m, k, s, marks=() if (m, k, s) in DEFAULT else pytest.mark.slow)
         for m in ("standard", "block") for k in (1, 3) for s in SCENARIOS]


@pytest.mark.parametrize(("method", "k", "name"), CASES)
def test_lossless_methods_reproduce_the_target(method, k, name):
    p_first, p_joint = fit_pvalues(name, k, method)
    assert p_first > 1e-3, f"first token: chi-square p = {p_first:.2e}"
    assert p_joint > 1e-3, f"first two tokens: chi-square p = {p_joint:.2e}"


@pytest.mark.parametrize("broken", ["residual-is-p", "ratio-q-over-p"])
def test_the_check_catches_broken_verifiers(broken):
    p_first, p_joint = fit_pvalues("peaked", 1, broken)
    assert p_first < 1e-6 and p_joint < 1e-6, (p_first, p_joint)


def test_block_accepts_more_than_standard_with_the_same_law():
    k, trials = 3, 40_000
    first_s, second_s, acc_s = simulate("two-token", k, "standard", trials)
    first_b, second_b, acc_b = simulate("two-token", k, "block", trials)
    beta = 2 / 3  # sum_x min(P, Q): standard's per-draft acceptance on iid rows
    std_err = math.sqrt((acc_s.var() + acc_b.var()) / trials)
    assert acc_s.mean() == pytest.approx(sum(beta**j for j in range(1, k + 1)), abs=5 * std_err)
    assert acc_b.mean() - acc_s.mean() > 10 * std_err  # ~1.41 vs ~1.66 tokens, std_err ~0.006
    for method in ("standard", "block"):
        assert min(fit_pvalues("two-token", k, method, trials)) > 1e-3
    # both laws equal, tested directly: a two-sample chi-square on the first two tokens
    cells_s = np.bincount(first_s * V + second_s, minlength=V * V)
    cells_b = np.bincount(first_b * V + second_b, minlength=V * V)
    keep = (cells_s + cells_b) > 0
    both = cells_s[keep] + cells_b[keep]
    stat = (((cells_s[keep] - both / 2) ** 2 + (cells_b[keep] - both / 2) ** 2) / (both / 2)).sum()
    assert chi2_sf(float(stat), int(keep.sum()) - 1) > 1e-3


# ---- table tests ----------------------------------------------------------------------------------

def _onehot(ids: list[int], vocab: int = V) -> np.ndarray:
    return np.eye(vocab)[ids]


@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize(("drafts", "target"), [([1, 2, 3], [1, 2, 3, 4]), ([1, 2, 3], [1, 5, 3, 4]),
                                                ([4, 2], [0, 2, 1]), ([], [3])])
def test_one_hot_target_is_greedy_verification(method, drafts, target):
    """A temperature-0 target (one-hot rows): accept while drafts match, then its token, any uniforms."""
    p = _onehot(target)
    rng = np.random.default_rng(1)
    for q in (None, _softmax(rng.standard_normal((len(drafts), V))) if drafts else np.zeros((0, V))):
        for _ in range(20):
            u = rng.random((len(drafts) + 1, 2))
            out = verify_sampled(drafts, p, q, u, RejectionConfig(method=method))
            assert out == accept_matching(drafts, target)


def test_zero_mass_residual_falls_back_to_the_target_row():
    p = np.array([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = np.array([[0.5, 0.9, 0.3, 0.3]])  # q >= p everywhere (not normalised): max(p - q, 0) == 0
    for method in ("standard", "block"):
        out = verify_sampled([1], p, q, np.array([[0.99, 0.7], [0.0, 0.0]]), RejectionConfig(method=method))
        assert out == [1]  # rejected (0.99 * 0.9 >= 0.5), then a draw from p[0] with u = 0.7


def test_synthetic_acceptance_is_geometric():
    rng = np.random.default_rng(2)
    k, trials = 4, 20_000
    p = _softmax(rng.standard_normal((k + 1, V)))
    p[:, 5] = 0.0
    for rate in (0.0, 0.3, 0.8, 1.0):
        cfg = RejectionConfig(method="synthetic", synthetic_acceptance_rate=rate)
        drafts = [5, 5, 5, 5]  # zero target probability: accepted anyway, it is lossy by design
        lengths = np.array([len(verify_sampled(drafts, p, None, rng.random((k + 1, 2)), cfg)) - 1
                            for _ in range(trials)])
        expected = sum(rate**j for j in range(1, k + 1))  # E[min(Geometric, K)]
        tolerance = max(5 * lengths.std() / math.sqrt(trials), 1e-12)
        assert lengths.mean() == pytest.approx(expected, abs=tolerance)
    # the token after a rejection is a draw from the target row at that position
    cfg = RejectionConfig(method="synthetic", synthetic_acceptance_rate=0.5)
    u = np.array([[0.1, 0.0], [0.9, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert verify_sampled([5, 5, 5, 5], _onehot([0, 1, 2, 3, 4]), None, u, cfg) == [5, 1]


def test_typical_acceptance():
    cfg = RejectionConfig(method="typical")
    peaked = np.array([0.01, 0.9, 0.03, 0.02, 0.03, 0.01])
    flat = np.full(50, 0.02)  # entropy log 50: threshold min(0.09, 0.3 / 50) = 0.006
    p = np.stack([peaked, peaked, _onehot([4])[0]])
    u = np.full((3, 2), 0.5)
    assert verify_sampled([1, 1], p, None, u, cfg) == [1, 1, 4]  # the mode passes, then the bonus draw
    assert verify_sampled([1, 0], p, None, u, cfg) == [1, 1]  # p = 0.01 fails: argmax p_1 is recovered
    assert verify_sampled([3], p[:2], None, u[:2], cfg) == [1]
    low = flat.copy()
    low[[7, 8]] = [0.005, 0.035]
    pf = np.stack([low, flat])
    assert verify_sampled([9], pf, None, u[:2], cfg)[0] == 9  # 0.02 < 0.09 passes on a flat row
    assert verify_sampled([7], pf, None, u[:2], cfg) == [8]  # 0.005 < 0.3 * exp(-H) is rejected
    strict = RejectionConfig(method="typical", posterior_threshold=0.01, posterior_alpha=1.0)
    assert verify_sampled([0, 0], p, None, u, strict) == [1]  # 0.01 is not > 0.01: argmax emitted


@pytest.mark.parametrize("method", ["standard", "block", "synthetic", "typical"])
def test_same_uniforms_same_output_and_inputs_untouched(method):
    rng = np.random.default_rng(3)
    k, vocab = 4, 300  # wider than one inverse-CDF chunk
    p = _softmax(rng.standard_normal((k + 1, vocab)) * 2)
    q = _softmax(rng.standard_normal((k, vocab)) * 2)
    cfg = RejectionConfig(method=method, synthetic_acceptance_rate=0.6)
    outs = set()
    for _ in range(50):
        drafts = [int(sample_from(q[i], rng.random())) for i in range(k)]
        u = rng.random((k + 1, 2))
        p0, q0, u0 = p.copy(), q.copy(), u.copy()
        for qq in (q, None):
            first = verify_sampled(drafts, p, qq, u, cfg)
            q_copy = None if qq is None else q.copy()
            assert verify_sampled(list(drafts), p.copy(), q_copy, u.copy(), cfg) == first
            assert 1 <= len(first) <= k + 1 and first[: len(first) - 1] == drafts[: len(first) - 1]
            outs.add(tuple(first))
        assert np.array_equal(p, p0) and np.array_equal(q, q0) and np.array_equal(u, u0)
    if method != "typical":  # typical only draws the bonus token
        assert len(outs) > 10  # the uniforms do matter


def test_sample_from_matches_a_plain_inverse_cdf_and_skips_zeros():
    rng = np.random.default_rng(4)
    for vocab in (5, 300, 1000, 49152):  # below, across and far past the chunked path
        row = rng.random(vocab) * (rng.random(vocab) < 0.3)
        row[-1] = 0.0
        row = (row / row.sum()).astype(np.float32)
        for scale in (1.0, 0.999, 1.001):
            ref = np.cumsum(row.astype(np.float64) * scale)
            for u in (*rng.random(200), 0.0, np.nextafter(1.0, 0.0)):
                i = sample_from(row * np.float32(scale), u)
                assert row[i] > 0
                want = min(int(np.searchsorted(ref, u * ref[-1], side="right")), int(np.flatnonzero(row)[-1]))
                t = u * ref[-1]
                assert i == want or min(abs(ref[i] - t), abs(ref[want] - t)) < 1e-5  # a float tie only
    with pytest.raises(ValueError):
        sample_from(np.zeros(4), 0.5)


def test_rejects_bad_shapes_and_configs():
    p, u = np.full((3, 4), 0.25), np.zeros((3, 2))
    with pytest.raises(ValueError):
        verify_sampled([1], p, None, u, RejectionConfig())  # p has K+2 rows
    with pytest.raises(ValueError):
        verify_sampled([1, 2], p, np.full((1, 4), 0.25), u, RejectionConfig())
    with pytest.raises(ValueError):
        verify_sampled([1, 4], p, None, u, RejectionConfig())  # draft outside the vocabulary
    with pytest.raises(ValueError):
        RejectionConfig(method="synthetic")
    with pytest.raises(ValueError):
        RejectionConfig(method="synthetic", synthetic_acceptance_rate=1.5)
    with pytest.raises(ValueError):
        RejectionConfig(method="strict")  # the config parser maps the alias before building this
