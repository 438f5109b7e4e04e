"""The adaptive controller's step cost model: the token curve per request count, the fitted draft prices,
and the exploring steps that measure them."""

from __future__ import annotations

import random

import pytest

from engine.spec.adaptive import AdaptiveController, Candidate
from engine.spec.cost_model import StepCostModel
from tests.spec.test_adaptive import controller


def test_cost_model_interpolates_a_concave_curve_and_stays_monotone() -> None:
    m = StepCostModel()
    assert m.predict(1) == pytest.approx(0.042)  # the prior line before any step is seen
    curve = {1: 0.040, 2: 0.044, 4: 0.052, 8: 0.060, 16: 0.064, 32: 0.080, 512: 2.0}
    for _ in range(5):
        for n, t in curve.items():
            m.observe(n, t)
    for n, t in curve.items():
        assert m.predict(n) == pytest.approx(t, rel=1e-6)
    assert m.predict(12) == pytest.approx(0.062)  # between the 8 and 16 buckets
    assert m.marginal(10) == pytest.approx(0.0005) and m.marginal(100) > m.marginal(10)
    assert m.predict(1024) > m.predict(512)  # extrapolated with the last segment's slope
    noisy = StepCostModel()
    for n, t in ((1, 0.05), (8, 0.04)) * 3:  # a busy machine: more tokens measured cheaper
        noisy.observe(n, t)
    assert noisy.predict(8) >= noisy.predict(1) and noisy.marginal(4) > 0


def row_cost(rows: int, tokens: int) -> float:
    """A machine where each request in a step costs far more than each extra token of a request (its
    attention and per-request work), like this CPU: 3 requests x 1 token >> 1 request x 3 tokens."""
    return 0.030 + 0.030 * rows + 0.002 * (tokens - rows)


def test_cost_model_keeps_request_counts_apart() -> None:
    m = StepCostModel()
    for _ in range(5):
        for rows in range(1, 9):
            m.observe(rows, row_cost(rows, rows), num_rows=rows)  # plain decode
        for k in (2, 4):
            m.observe(1 + k, row_cost(1, 1 + k), num_rows=1)  # one request verifying k drafts
    assert m.predict(3, num_rows=1) == pytest.approx(row_cost(1, 3), rel=1e-6)
    assert m.predict(3, num_rows=3) == pytest.approx(row_cost(3, 3), rel=1e-6)
    assert m.marginal(3, num_rows=1) == pytest.approx(0.002, rel=1e-6)
    # Tokens alone mix the two: the pooled curve prices a draft token like a whole request.
    assert m.marginal(3) > 0.01
    # A request count seen only without drafts: the pooled curve's shape through its one point.
    assert m.predict(5, num_rows=5) == pytest.approx(row_cost(5, 5), rel=1e-6)
    assert m.predict(6, num_rows=5) > m.predict(5, num_rows=5)
    # Never seen at all: the pooled curve.
    assert m.predict(40, num_rows=32) == pytest.approx(m.predict(40))


def test_drafts_priced_at_the_steps_request_count() -> None:
    # One request left after a batch drained, drafts accepted half the time: at 2 ms a draft token
    # even the 4th (reached 1 time in 16) pays; priced from tokens alone (a draft token looks like
    # another request's row) only the first does.
    c, one = controller(fixed=0.0, per_token=0.0, accept=0.5, max_k=4)
    c.cost = StepCostModel()
    for _ in range(5):
        for rows in range(1, 9):
            c.observe_step(rows, row_cost(rows, rows), num_rows=rows)
        for k in (1, 2, 4):
            c.observe_step(1 + k, row_cost(1, 1 + k), num_rows=1)
    assert c.choose(one, base_tokens=1, num_rows=1) == [4]
    assert c.choose(one, base_tokens=1) == [1]


def test_a_dear_first_draft_does_not_hide_cheap_later_ones() -> None:
    # One request on the curve measured here (55 ms plain, +35 ms for the first draft token, +5 ms for
    # each after it) with position-0 acceptance 0.6: the first token alone does not pay (0.6 tokens for
    # 35 ms against 1 per 55 ms), four together do (3.1 tokens in 110 ms against 1 in 55 ms).
    c, one = controller(fixed=0.0, per_token=0.0, accept=0.9, max_k=4)
    c.cost = StepCostModel()
    for _ in range(5):
        for tokens, seconds in ((1, 0.055), (2, 0.090), (3, 0.095), (4, 0.100), (5, 0.105)):
            c.observe_step(tokens, seconds, num_rows=1)
    for _ in range(300):  # position 0 right 6 times in 10, later ones nearly always
        c.observe_verification("r0", 4, 4 if random.Random(_).random() < 0.6 else 0)
    assert 0.5 < c.acceptance.probabilities("r0")[0] < 0.7
    assert c.choose(one, base_tokens=1, num_rows=1) == [4]
    # With a flat price per draft token the same acceptance buys nothing: no hidden cheap tail.
    c.cost = StepCostModel()
    for _ in range(5):
        for tokens in range(1, 6):
            c.observe_step(tokens, 0.055 + 0.035 * (tokens - 1), num_rows=1)
    assert c.choose(one, base_tokens=1, num_rows=1) == [0]


def test_draft_price_keeps_request_counts_apart_within_a_bucket() -> None:
    # The 32-request bucket holds steps of 17-32 requests. Requests cost 15 ms each, drafts 5 ms. Where
    # the wave drains (fewer requests, one draft each at most) while full steps draft more, the bucket's
    # token curve mixes the two and overprices drafts; the fitted price does not.
    rng = random.Random(0)
    m = StepCostModel()
    for _ in range(80):
        rows = rng.choice([18, 24, 28, 32])
        drafts = rng.choice([0, 1]) * rows if rows < 32 else rng.choice([0, 32, 64, 96])
        m.observe(rows + drafts, 0.05 + 0.015 * rows + 0.005 * drafts + rng.gauss(0, 0.005), num_rows=rows)
    assert m.draft_marginal(64, num_rows=32) == pytest.approx(0.005, rel=0.1)
    assert m.marginal(64, num_rows=32) > 1.2 * 0.005  # the token curve alone, read at 32 requests
    # No spread of draft counts yet (one request, 0-4 drafts): the token curve's slope stands in.
    one = StepCostModel()
    for k in (0, 1, 2, 3, 4) * 4:
        one.observe(1 + k, 0.048 + 0.003 * k, num_rows=1)
    assert one.draft_marginal(2, num_rows=1) == pytest.approx(one.marginal(2, num_rows=1))


def sixteen_requests_fitted(rng: random.Random, noise: float = 0.0) -> StepCostModel:
    """120 steps of 16 requests taking 0-4 drafts each; a drafting request costs 5 ms more than its
    tokens, each draft token 2 ms (the shape measured here: K = 0/1/2/4 at 441/552/574/662 ms)."""
    m = StepCostModel()
    for _ in range(120):
        ks = [rng.choice([0, 0, 1, 2, 3, 4]) for _ in range(16)]
        drafting, drafts = sum(1 for k in ks if k), sum(ks)
        seconds = 0.44 + 0.005 * drafting + 0.002 * drafts + rng.gauss(0, noise)
        m.observe(16 + drafts, seconds, num_rows=16, num_drafting=drafting)
    return m


def test_a_requests_first_draft_is_priced_apart_from_the_next_ones() -> None:
    rng = random.Random(0)
    m = sixteen_requests_fitted(rng, noise=0.003)
    assert m.draft_marginal(40, num_rows=16, first=True) == pytest.approx(0.007, rel=0.15)
    assert m.draft_marginal(40, num_rows=16) == pytest.approx(0.002, rel=0.25)
    # Every drafting request takes the same K: the two terms cannot be told apart, one price per token
    # (the mean cost of a draft token, 3.25 ms at K = 4).
    same = StepCostModel()
    for _ in range(120):
        n = rng.randint(0, 16)
        same.observe(16 + 4 * n, 0.44 + 0.013 * n + rng.gauss(0, 0.003), num_rows=16, num_drafting=n)
    first, more = same.draft_marginal(40, 16, first=True), same.draft_marginal(40, 16)
    assert first == more == pytest.approx(0.00325, rel=0.15)
    # Once told apart, a steady stretch (16 requests drafting every step, 40-64 drafts) keeps the split.
    for _ in range(200):
        drafts = rng.randint(40, 64)
        m.observe(16 + drafts, 0.44 + 0.005 * 16 + 0.002 * drafts + rng.gauss(0, 0.003), num_rows=16,
                  num_drafting=16)
    assert m.draft_marginal(40, num_rows=16, first=True) == pytest.approx(0.007, rel=0.15)
    assert m.draft_marginal(40, num_rows=16) == pytest.approx(0.002, rel=0.25)
    # Noise that fits a negative price per draft is no price at all (the curve stands in), not free drafts.
    neg = StepCostModel()
    for d in (0, 8, 16, 0, 8, 16):
        neg.observe(16 + d, 0.44 - 0.001 * d, num_rows=16, num_drafting=min(d, 16))
    assert neg.draft_prices(16) is None


def test_draft_price_survives_a_machine_that_drifts_as_drafts_rise() -> None:
    # Recorded here (mtp, 8 requests): plain steps went 270 -> 220 ms within seconds while the controller,
    # reading those faster steps as cheap drafts, drafted more. Drafts cost 12 ms each. A fit of step
    # levels priced them at ~0 and drafting ran on at acceptance 0.2; differences of neighbouring steps
    # cancel the drift.
    rng = random.Random(1)
    m = StepCostModel()
    drafts = [0, 0, 1, 1, 1, 6, 2, 3, 2, 2, 3, 3, 2, 2, 2, 2, 2, 3, 3, 5, 6, 6, 5, 5, 3, 4, 6, 6, 7, 5]
    for i, d in enumerate(drafts):
        level = 0.27 - 0.05 * i / len(drafts)  # the machine speeds up by a fifth over the stretch
        m.observe(8 + d, level + 0.012 * d + rng.gauss(0, 0.003), num_rows=8, num_drafting=min(d, 8))
    assert m.draft_marginal(12, num_rows=8) == pytest.approx(0.012, rel=0.25)
    # A prefill step between two decode steps breaks the pair: its time says nothing about drafts.
    m.interrupt()
    m.observe(16, 0.9, num_rows=8, num_drafting=8)
    assert m.draft_marginal(12, num_rows=8) == pytest.approx(0.012, rel=0.25)


def test_a_new_load_level_borrows_the_nearest_levels_draft_prices() -> None:
    # 16 requests fitted (first draft 7 ms, further ones 2 ms); then the first steps at 32 requests,
    # whose draft counts have not varied yet: their token curve's slope would price every draft like a
    # first one, so the 16-request prices stand in until the 32-request steps fit their own.
    rng = random.Random(0)
    m = sixteen_requests_fitted(rng)
    m.observe(32, 0.40, num_rows=32, num_drafting=0)
    m.observe(62, 0.85, num_rows=32, num_drafting=30)  # one draft each: 15 ms per draft on the curve
    assert m.marginal(40, num_rows=32) == pytest.approx(0.015, rel=0.05)
    assert m.draft_marginal(40, num_rows=32, first=True) == pytest.approx(0.007, rel=0.1)
    assert m.draft_marginal(40, num_rows=32) == pytest.approx(0.002, rel=0.1)
    assert m.measured(32)
    # Not from further than a factor of two: 64 requests (32 unfitted, 16 four times fewer) use the curve.
    assert m.draft_prices(64) is None
    # Once the 32-request steps vary their drafts, their own prices win.
    for _ in range(120):
        ks = [rng.choice([0, 0, 1, 2, 3, 4]) for _ in range(32)]
        drafting, drafts = sum(1 for k in ks if k), sum(ks)
        m.observe(32 + drafts, 0.40 + 0.008 * drafting + 0.004 * drafts, num_rows=32, num_drafting=drafting)
    assert m.draft_marginal(40, num_rows=32, first=True) == pytest.approx(0.012, rel=0.1)
    assert m.draft_marginal(40, num_rows=32) == pytest.approx(0.004, rel=0.1)


def test_a_cold_load_level_explores_until_its_drafts_are_priced() -> None:
    # A server warmed by one request, then a wave of 32: no draft prices at 32 requests or near it, and
    # the token curve there has one point, so its slope is the pooled curve's, where tokens grew by
    # requests (~12 ms a token; a draft costs ~5). Drafts accepted 8 times in 10 would not pay at that
    # price. Every other step prices verification at nothing; the fit settles on the steps that result,
    # and the alternation stops.
    c, many = controller(fixed=0.0, per_token=0.0, accept=0.8, max_k=4, requests=32)
    c.cost = StepCostModel()
    for _ in range(5):
        for tokens, seconds in ((1, 0.055), (2, 0.090), (3, 0.115), (5, 0.165)):
            c.observe_step(tokens, seconds, num_rows=1)
    c.observe_step(32, 0.46, num_rows=32, num_drafting=0)
    assert c.cost.draft_price_unknown(32) and not c.cost.draft_price_unknown(1)
    assert c.cost.draft_marginal(40, num_rows=32) > 0.01
    sums = []
    for _ in range(12):
        ks = c.choose(many, base_tokens=32, num_rows=32)
        sums.append(sum(ks))
        drafting = sum(1 for k in ks if k)
        c.observe_step(32 + sum(ks), 0.46 + 0.002 * drafting + 0.004 * sum(ks), num_rows=32,
                       num_drafting=drafting)
    assert sums[0] == 128  # the first step explores
    assert not c.cost.draft_price_unknown(32)
    assert c.cost.draft_marginal(40, num_rows=32, first=True) == pytest.approx(0.006, rel=0.1)
    assert c.cost.draft_marginal(40, num_rows=32) == pytest.approx(0.004, rel=0.1)
    # Priced: three drafts each at least (the third, 0.51 tokens for 4 ms, beats the step's rate).
    assert all(x >= 96 for x in sums[-3:])
    # Measured prices that make drafting lose: no exploring step drafts at all.
    c2, many2 = controller(fixed=0.0, per_token=0.0, accept=0.1, max_k=4, requests=32)
    c2.cost = c.cost
    assert sum(c2.choose(many2, base_tokens=32, num_rows=32)) == 0
    assert sum(c2.choose(many2, base_tokens=32, num_rows=32)) == 0


def test_exploring_steps_leave_out_drafts_unlikely_to_be_accepted() -> None:
    # The cold level above with sampled requests' acceptance: their first draft is accepted about half the
    # time, a later one about a fifth. An exploring step takes each request's first draft (the fit's spread
    # comes from how many requests draft) and none of the deep ones, which would cost a row each for ~0.1
    # of a token; with drafts accepted 8 times in 10 it took all four (above).
    c = AdaptiveController(4, ema=0.02)
    many = [Candidate(f"r{i}", 4, bucket="(0.5,1]") for i in range(32)]
    rng = random.Random(0)
    for cand in many:
        for _ in range(400):
            accepted = int(rng.random() < 0.5)
            accepted += accepted and rng.random() < 0.2
            c.observe_verification(cand.request_id, 2, accepted, bucket=cand.bucket)
    for _ in range(5):
        for tokens, seconds in ((1, 0.055), (2, 0.090), (3, 0.115), (5, 0.165)):
            c.observe_step(tokens, seconds, num_rows=1)
    c.observe_step(32, 0.46, num_rows=32, num_drafting=0)
    assert c.cost.draft_price_unknown(32)
    ks = c.choose(many, base_tokens=32, num_rows=32)
    assert ks == [1] * 32
