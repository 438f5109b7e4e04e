"""Adaptive speculation (`"num_speculative_tokens": "auto"`): each step, per request, pick the number
of draft tokens (0 included) that maximises expected tokens per second of the whole step.

Inputs, all learned online from the engine's own measurements:
- `StepCostModel`: target step seconds as a function of the step's tokens at its number of requests,
  piecewise linear through a smoothed point per token-count bucket of the engine's decode/verify steps
  with that many requests (a pooled curve, then a prior line, while those are unknown); the prices of
  a request's first draft token and of each further one from a least-squares fit of the changes between
  consecutive such steps in requests, drafting requests and draft tokens (`DraftPriceFit`: differences
  cancel the machine's drift), once their draft counts have varied (until then a nearby request
  count's prices; where none, every other step explores);
- draft cost per drafted token (the proposer's own time: ~0 for ngram/suffix, a draft forward for
  draft_model), an exponential moving average;
- `AcceptanceEstimator`: per request and per position, the probability that the draft at position i is
  accepted given the ones before were, smoothed (EMA) and seeded by the method's running average.
Requests that stop drafting are re-probed with one token after a doubling number of idle steps.

Allocation ranks draft tokens by value (the probability g that each is reached and accepted) and
keeps the prefix of that ranking with the best rate G / C (expected tokens over predicted step
seconds, one more verified token plus its draft per draft token). Under load (large C, large G) only
confident drafts make the rate grow; at batch 1 with cheap verification most do. Pure Python.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

# Probability assumed for a position the request has never reached (before any method average).
_PRIOR_ACCEPT = 0.5


def _bucket(n: int) -> int:
    """Token and request counts are bucketed alike: exact up to 8, then powers of two."""
    return n if n <= 8 else 1 << (n - 1).bit_length()


class TokenCurve:
    """Step seconds as a function of the step's tokens.

    The curve is not a line on a CPU: a few rows cost almost one row's weight streaming, more rows move
    the matmuls into an efficient GEMM regime, and long prefill chunks are compute-bound. So the model
    keeps a smoothed (tokens, seconds) point per token-count bucket (exact up to 8 tokens, then powers of
    two) and interpolates between them, monotone, extrapolating with the outer segments' slopes; a prior
    line stands in until two buckets are known."""

    def __init__(self, prior: tuple[float, float] = (0.035, 0.007), ema: float = 0.2,
                 min_slope: float = 1e-5) -> None:
        self.prior_fixed, self.prior_per_token = prior
        self.ema = ema
        self.min_slope = min_slope
        self._buckets: dict[int, list[float]] = {}  # bucket -> [mean tokens, mean seconds, count]
        self._points: list[tuple[float, float]] | None = None


    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        b = self._buckets.get(_bucket(num_tokens))
        if b is None:
            self._buckets[_bucket(num_tokens)] = [float(num_tokens), seconds, 1.0]
        else:
            a = max(self.ema, 1.0 / (b[2] + 1))  # plain mean for the first few, then an EMA
            b[0] += a * (num_tokens - b[0])
            b[1] += a * (seconds - b[1])
            b[2] += 1
        self._points = None

    def points(self) -> list[tuple[float, float]]:
        if self._points is None:
            pts = sorted((x, y) for x, y, _ in self._buckets.values())
            mono, top = [], 0.0
            for x, y in pts:  # more tokens never cost less
                top = max(top, y)
                mono.append((x, top))
            self._points = mono
        return self._points

    def predict(self, num_tokens: float) -> float:
        pts = self.points()
        if not pts:
            return self.prior_fixed + self.prior_per_token * num_tokens
        if len(pts) == 1:
            x0, y0 = pts[0]
            return max(0.0, y0 + self.prior_per_token * (num_tokens - x0))
        if num_tokens <= pts[0][0]:
            (x0, y0), (x1, y1) = pts[0], pts[1]
        elif num_tokens >= pts[-1][0]:
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
        else:
            i = next(i for i in range(1, len(pts)) if pts[i][0] >= num_tokens)
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        slope = max((y1 - y0) / (x1 - x0), self.min_slope) if x1 > x0 else self.prior_per_token
        return max(0.0, y0 + slope * (num_tokens - x0))

    def marginal(self, num_tokens: float) -> float:
        """Seconds one more token adds to a step of `num_tokens`."""
        return max(self.predict(num_tokens + 1) - self.predict(num_tokens), self.min_slope)


class DraftPriceFit:
    """Draft prices at one request-count bucket: a recency-weighted least-squares fit of the change in
    step seconds between consecutive steps = a + b * change in requests + c1 * change in requests
    drafting + c2 * change in draft tokens. A request's first draft token costs c1 + c2, each further
    one c2.

    Why changes between neighbouring steps, not the step times themselves: this machine drifts by 20-25%
    within seconds (8 requests, no drafts: 160 ms, then 270 ms four seconds later), and the controller's
    own choices follow its prices, so drafts rose while the machine sped up. A fit of levels read that
    as drafts that cost nothing (11.6 ms to 0.0 within ten steps where a draft costs ~12 ms) and auto
    drafted 2-3 tokens a step at acceptance 0.2. A difference of two steps a quarter second apart cancels
    the drift; pairs whose drafts did not change say nothing about them and are left out, so a steady
    stretch keeps its prices instead of forgetting them.

    Why two draft terms: a request that drafts turns its one-token row into a multi-token query, and
    that costs more than the tokens do (16 requests here, static K = 0/1/2/4: 441/552/574/662 ms, so ~7
    ms for a request's first draft token and ~2 ms for each one after); one price per token overprices
    deep drafts and underprices shallow ones. Why requests as a term: a bucket above 8 spans many
    request counts (17-32), and a request that finishes changes the step by more than its drafts did.
    While the drafting-request count has not varied apart from the draft count (every drafting request
    took the same K), the fit keeps one price per token (c1 = 0)."""

    def __init__(self, decay: float = 0.97, min_spread: float = 16.0,
                 min_request_spread: float = 8.0, split_only: bool = False) -> None:
        # `split_only`: prices only once the first and further drafts were told apart (one request: see
        # StepCostModel.draft_prices).
        self.split_only = split_only
        self.decay = decay  # per informative pair: ~33 pairs of memory
        # Weighted sum of squares of draft-count changes (about their mean) needed to trust c2: the price's
        # error is the pairs' noise over its square root (~4 ms / 4 at 8 requests here). A sum, not a
        # variance: drafts move by 1-2 a step at a few requests, and more pairs of those do make a price.
        self.min_spread = min_spread
        # ... and of drafting-request changes not explained by draft-count changes, to trust c1.
        self.min_request_spread = min_request_spread
        self._xx = [[0.0] * 4 for _ in range(4)]
        self._xy = [0.0] * 4
        self._prev: tuple[tuple[float, float, float], float] | None = None
        self._fitted = False  # prices() is asked once per candidate draft token: solve once per step
        self._prices: tuple[float, float] | None = None
        self._split: tuple[float, float] | None = None  # the last fit that told the two prices apart

    def observe(self, num_rows: int, num_drafts: int, seconds: float,
                num_drafting: int | None = None, follows: bool = True) -> None:
        """One decode/verify step; `follows`: the previous observation was the step just before it."""
        drafting = float(num_drafting if num_drafting is not None else min(num_drafts, num_rows))
        cur = (float(num_rows), drafting, float(num_drafts))
        prev, self._prev = self._prev, (cur, seconds)
        if prev is None or not follows:
            return
        d_rows, d_drafting, d_drafts = (a - b for a, b in zip(cur, prev[0], strict=True))
        if d_drafting == 0 and d_drafts == 0:
            return
        self._fitted = False
        x = (1.0, d_rows, d_drafting, d_drafts)
        dy = seconds - prev[1]
        for i in range(4):
            self._xy[i] = self.decay * self._xy[i] + x[i] * dy
            for j in range(4):
                self._xx[i][j] = self.decay * self._xx[i][j] + x[i] * x[j]

    @property
    def weight(self) -> float:
        """Decayed number of step pairs the fit rests on."""
        return self._xx[0][0]

    def prices(self) -> tuple[float, float] | None:
        """(first draft token of a request, each further one) in seconds; None while draft counts have
        not varied enough to tell them apart from the rest of the step (with `split_only`: or while the
        two prices have never been told apart)."""
        if not self._fitted:
            self._prices, self._fitted = self._fit(), True
        if self.split_only and self._prices is not self._split:
            return None
        return self._prices

    def _fit(self) -> tuple[float, float] | None:
        xx, w = self._xx, self._xx[0][0]
        if w <= 0:
            return None
        mr, md = xx[0][2] / w, xx[0][3] / w
        ss_d = xx[3][3] - w * md * md
        if ss_d < self.min_spread:
            return None
        ss_r, sp = xx[2][2] - w * mr * mr, xx[2][3] - w * mr * md
        if ss_r - sp * sp / ss_d >= self.min_request_spread:
            coef = self._lsq((0, 1, 2, 3))
            if coef is not None and coef[2] >= 0 and coef[3] > 0:
                self._split = (coef[2] + coef[3], coef[3])
                return self._split
            # A first draft cheaper than the next ones, or a further one that costs nothing, is noise.
        if self._split is not None:
            # Steady load (every step ~the same requests drafting, only the draft count moving) cannot
            # tell the two prices apart: keep the last split rather than one mean price, which prices
            # further drafts at ~6 ms where they cost ~4 (32 requests) and stops them at K ~3.
            return self._split
        coef = self._lsq((0, 1, 3))
        # A negative price is noise in a few steps, not free drafts.
        return None if coef is None or coef[2] <= 0 else (coef[2], coef[2])

    def _lsq(self, terms: tuple[int, ...]) -> list[float] | None:
        a = [[self._xx[i][j] for j in terms] for i in terms]
        # Ridge: where the request count never changed between paired steps its term is all zeros.
        a[1][1] += 1e-6 * (a[1][1] + 1.0)
        for k in range(2, len(terms)):
            a[k][k] += 1e-9 * (a[k][k] + 1.0)
        return _solve(a, [self._xy[i] for i in terms])


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


class StepCostModel:
    """Step seconds as a function of the step's tokens and of how many requests (rows) it serves,
    learned from the engine's own steps.

    Tokens alone do not say what a step costs: every request adds its own attention over its context
    and per-request work, so 3 requests x 1 token cost far more than 1 request x 3 tokens (92 vs 54 ms
    here). Drafting adds tokens to a step whose request count is fixed, so the marginal cost of a draft
    must come from steps with that many requests. One curve per request-count bucket (exact up to 8,
    then powers of two), plus a pooled curve over all steps that stands in while a bucket is thin: with
    one known point the bucket is the pooled curve's shape shifted through it."""

    def __init__(self, prior: tuple[float, float] = (0.035, 0.007), ema: float = 0.2) -> None:
        self._prior, self._ema = prior, ema
        self.pooled = TokenCurve(prior, ema)
        self._by_rows: dict[int, TokenCurve] = {}
        self._draft_fit: dict[int, DraftPriceFit] = {}
        # A bucket's own draft prices count once fitted on this many (decayed) step pairs; before that a
        # fit on two or three steps has seen one K mix and prices every draft like a request's first.
        self.own_fit_steps = 6.0
        self._last_bucket: int | None = None  # the bucket of the step just observed, for step pairs

    def observe(self, num_tokens: int, seconds: float, num_rows: int | None = None,
                num_drafting: int | None = None) -> None:
        """One decode/verify step: `num_rows` requests, `num_drafting` of them verifying drafts."""
        if num_tokens <= 0 or seconds <= 0:
            return
        self.pooled.observe(num_tokens, seconds)
        if num_rows is not None and num_rows > 0:
            b = _bucket(num_rows)
            curve = self._by_rows.get(b)
            if curve is None:
                curve = self._by_rows[b] = TokenCurve(self._prior, self._ema)
            curve.observe(num_tokens, seconds)
            if num_tokens >= num_rows:  # decode/verify: one token per request plus its drafts
                fit = self._draft_fit.get(b)
                if fit is None:
                    fit = self._draft_fit[b] = DraftPriceFit(split_only=b == 1)
                fit.observe(num_rows, num_tokens - num_rows, seconds, num_drafting,
                            follows=self._last_bucket == b)
                self._last_bucket = b
                return
        self._last_bucket = None

    def interrupt(self) -> None:
        """A step the draft fits do not see (one with a prefill chunk) came between: the next step pairs
        with nothing."""
        self._last_bucket = None

    def predict(self, num_tokens: float, num_rows: int | None = None) -> float:
        curve = self._by_rows.get(_bucket(num_rows)) if num_rows else None
        pts = curve.points() if curve is not None else []
        if len(pts) >= 2:
            return curve.predict(num_tokens)  # type: ignore[union-attr]
        if len(pts) == 1:
            x0, y0 = pts[0]
            return max(0.0, y0 + self.pooled.predict(num_tokens) - self.pooled.predict(x0))
        return self.pooled.predict(num_tokens)

    def marginal(self, num_tokens: float, num_rows: int | None = None) -> float:
        """Seconds one more token adds to a step of `num_tokens` serving `num_rows` requests."""
        return max(self.predict(num_tokens + 1, num_rows) - self.predict(num_tokens, num_rows),
                   self.pooled.min_slope)

    def measured(self, num_rows: int | None = None) -> bool:
        """Whether draft prices at this request count come from steps (a fit, or a curve through at least
        two points) rather than from a prior."""
        if num_rows:
            curve = self._by_rows.get(_bucket(num_rows))
            if self.draft_prices(num_rows) is not None:
                return True
            return curve is not None and len(curve.points()) >= 2
        return len(self.pooled.points()) >= 2

    def draft_marginal(self, num_tokens: float, num_rows: int | None = None, first: bool = False) -> float:
        """Seconds one more draft token adds to a decode step serving `num_rows` requests (`first`: the
        request's first draft this step): the fitted prices of `draft_prices`, else the token curve's
        local slope."""
        p = self.draft_prices(num_rows)
        if p is None:
            return self.marginal(num_tokens, num_rows)
        return max(p[0] if first else p[1], self.pooled.min_slope)

    def draft_price_unknown(self, num_rows: int | None) -> bool:
        """True where nothing measured prices a draft at this request count: no settled fit here or within
        a factor of two, and no token curve that varies drafts alone (a request count of 8 or fewer with
        two points). There the curve's slope is a guess, and a bad one either way: above 8 requests, or
        with one point (the pooled curve's shape), the token axis mixes requests with drafts and read
        12-26 ms per draft at 17-32 requests after a one-request warm-up (0.01 ms in another run) where
        one costs ~6 ms, and auto drafted almost nothing through a c = 32 wave's ramp while static K = 4
        more than doubled its tokens per step."""
        if not num_rows or self._settled_prices(num_rows) is not None:
            return False
        b = _bucket(num_rows)
        curve = self._by_rows.get(b)
        return not (b <= 8 and curve is not None and len(curve.points()) >= 2)

    def draft_prices(self, num_rows: int | None) -> tuple[float, float] | None:
        """The fitted (first, further) draft prices at this request count; for its first steps (a new load
        level), those of the nearest bucket within a factor of two that has settled prices. Why borrow: at
        a new level the token curve's slope, or a fit on two or three steps of one K mix, prices every
        draft like a request's first (14 ms at 32 requests where further drafts cost 4): auto drafted 1-2
        tokens per request there where static K = 4 drafted four, in a wave of ~60 decode steps."""
        if not num_rows:
            return None
        if num_rows == 1:
            # One request: its token curve prices each K exactly (1 + K tokens), the first draft apart
            # from the next ones (~26 ms, then ~3 ms each here); one price per token from a fit that
            # cannot tell them apart (drafting moves with the drafts) would stop K at 1.
            fit = self._draft_fit.get(1)
            return fit.prices() if fit is not None else None
        settled = self._settled_prices(num_rows)
        if settled is not None:
            return settled
        fit = self._draft_fit.get(_bucket(num_rows))
        return fit.prices() if fit is not None else None

    def _settled_prices(self, num_rows: int) -> tuple[float, float] | None:
        """This bucket's prices once fitted on `own_fit_steps` steps, else the nearest settled bucket's
        within a factor of two, else None."""
        b = _bucket(num_rows)
        fit = self._draft_fit.get(b)
        own = fit.prices() if fit is not None else None
        if fit is not None and own is not None and fit.weight >= self.own_fit_steps:
            return own
        near = sorted((abs(math.log2(k / b)), -k) for k in self._draft_fit if k != b and k <= 2 * b <= 4 * k)
        for _, neg_k in near:
            other = self._draft_fit[-neg_k]
            p = other.prices()
            if p is not None and other.weight >= self.own_fit_steps:
                return p
        return None


@dataclass(slots=True)
class _RequestAcceptance:
    p: list[float] = field(default_factory=list)  # P(accept position i | accepted 0..i-1)
    seen: list[int] = field(default_factory=list)  # times position i was verified for this request
    idle_steps: int = 0  # consecutive steps with K = 0
    probe_after: int = 0  # re-probe once idle for this many steps (doubles per probe until drafting resumes)
    probing: bool = False  # a probe was chosen and its verification has not come back yet


class AcceptanceEstimator:
    def __init__(self, max_k: int, ema: float = 0.1, base_probe: int = 4, max_probe: int = 128,
                 prior_weight: float = 2.0) -> None:
        self.max_k = max_k
        self.ema = ema
        self.prior_weight = prior_weight
        self.base_probe = base_probe
        self.max_probe = max_probe
        # Method-wide running average per position: seeds new requests.
        self.global_hits = [0] * max_k
        self.global_tries = [0] * max_k
        self._req: dict[str, _RequestAcceptance] = {}
        # Share of probes accepted, over all requests: a running mean, then a moving average (weight 0.05).
        self.probe_yield = 0.0
        self.probes_seen = 0

    def method_average(self, i: int) -> float:
        tries = self.global_tries[i]
        if tries:
            return (self.global_hits[i] + _PRIOR_ACCEPT) / (tries + 1)
        # A position no request has reached yet: like the one before it, not a flat prior that would
        # keep K below it for good.
        return self.method_average(i - 1) if i > 0 else _PRIOR_ACCEPT

    def _state(self, request_id: str) -> _RequestAcceptance:
        st = self._req.get(request_id)
        if st is None:
            st = self._req[request_id] = _RequestAcceptance(
                p=[0.0] * self.max_k, seen=[0] * self.max_k, probe_after=self.base_probe)
        return st

    def probabilities(self, request_id: str) -> list[float]:
        """Per position: the request's own estimate where it has evidence; else the method's running
        average, read now (not frozen at admission); else the request's estimate one position back."""
        st = self._state(request_id)
        out: list[float] = []
        for i in range(self.max_k):
            if st.seen[i]:
                out.append(st.p[i])
            elif self.global_tries[i] or i == 0:
                out.append(self.method_average(i))
            else:
                out.append(out[i - 1])
        return out

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts accepted the first `num_accepted`.

        The seed counts as `prior_weight` observations: the request's own first verdicts move its
        estimate like a running mean (weight 1 / (seen + prior_weight)) until that falls to the EMA
        rate. With the EMA rate from the start, a request seeded low by the requests before it (a
        repetitive one after a run of free-form ones) needs ~10 accepted probes to draft again, and
        probes come at doubling intervals: it would not draft at all within 64 tokens."""
        st = self._state(request_id)
        if st.probing and num_drafts > 0:
            st.probing = False
            self.probes_seen += 1
            a = max(0.05, 1.0 / self.probes_seen)
            self.probe_yield = (1 - a) * self.probe_yield + a * float(num_accepted > 0)
        prior = self.probabilities(request_id)
        for i in range(min(num_drafts, self.max_k)):
            if i > num_accepted:
                break  # later positions were never reached: no evidence about them
            hit = 1.0 if i < num_accepted else 0.0
            if not st.seen[i]:
                st.p[i] = prior[i]
            st.seen[i] += 1
            a = max(self.ema, 1.0 / (st.seen[i] + self.prior_weight))
            st.p[i] = (1 - a) * st.p[i] + a * hit
            self.global_tries[i] += 1
            self.global_hits[i] += int(hit)
        if num_drafts > 0:
            st.idle_steps = 0

    def note_idle(self, request_id: str, can_probe: bool = True) -> bool:
        """Count a step without drafts; True when the request is due a probe (the next one then waits
        twice as long, until the request drafts by choice again). With `can_probe` False a due request
        stays due for a later step."""
        st = self._state(request_id)
        st.idle_steps += 1
        if st.idle_steps < st.probe_after or not can_probe:
            return False
        st.probe_after = min(st.probe_after * 2, self.max_probe)
        st.probing = True
        return True

    def has_evidence(self, request_id: str) -> bool:
        return self._state(request_id).seen[0] > 0

    def note_drafting(self, request_id: str) -> None:
        """The controller chose drafts on the estimate alone: probing starts over from the base wait."""
        self._state(request_id).probe_after = self.base_probe

    def release(self, request_id: str) -> None:
        self._req.pop(request_id, None)


@dataclass(slots=True)
class Candidate:
    request_id: str
    max_k: int  # what the request can take this step (length limits, static caps)
    # Tokens the proposer must process before this request's first draft (a draft model whose KV
    # fell behind while the request did not draft); 0 for proposers without per-request state.
    catch_up: int = 0


class AdaptiveController:
    PROBE_MIN_SEEN = 16  # probes back before their yield may stop re-probing

    def __init__(self, max_k: int, ema: float = 0.1, base_probe: int = 4, gate_probes: bool = False) -> None:
        self.max_k = max_k
        # Model drafts (draft_model, mtp): re-probes wait for a probe yield that pays. Not for lookups,
        # whose candidates already have a match, and whose acceptance comes in copied spans.
        self.gate_probes = gate_probes
        self.cost = StepCostModel()
        self.acceptance = AcceptanceEstimator(max_k, ema=ema, base_probe=base_probe)
        self.draft_cost_per_token = 0.0  # seconds, EMA of the proposer's time per drafted token
        self._draft_seen = False
        self._last_rows: int | None = None  # requests in the last step chosen for: the gauges' draft prices
        self._explore = False  # flips each step chosen at a request count whose draft price is unknown

    # -- observations ----------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float, num_rows: int | None = None,
                     num_drafting: int | None = None) -> None:
        self.cost.observe(num_tokens, seconds, num_rows, num_drafting)

    def skip_step(self) -> None:
        """A step that is not decode/verify ran: the cost model does not see it, and the draft prices'
        step pairs must not span it."""
        self.cost.interrupt()

    def observe_draft(self, num_draft_tokens: int, seconds: float) -> None:
        if num_draft_tokens <= 0:
            return
        per = seconds / num_draft_tokens
        seen = self._draft_seen
        self.draft_cost_per_token = 0.8 * self.draft_cost_per_token + 0.2 * per if seen else per
        self._draft_seen = True

    def observe_verification(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.observe(request_id, num_drafts, num_accepted)

    def release(self, request_id: str) -> None:
        self.acceptance.release(request_id)

    # -- the choice ------------------------------------------------------------------------------
    def choose(self, candidates: list[Candidate], base_tokens: int, base_yield: int | None = None,
               num_rows: int | None = None) -> list[int]:
        """K per candidate for the next step. `base_tokens`: tokens the step computes without drafts
        (decode rows + prefill chunks); `base_yield`: tokens it emits without drafts (default: one per
        candidate); `num_rows`: requests in the step (default: unknown, the pooled cost curve)."""
        ks = [0] * len(candidates)
        if not candidates:
            return ks
        self._last_rows = num_rows
        # Where nothing prices a draft at this request count, every other step prices verification at
        # nothing (the proposer's own time still counts): steps with and without drafts side by side
        # give the fit its spread within a few steps, and the other steps keep the curve's guess.
        explore = False
        if self.cost.draft_price_unknown(num_rows):
            self._explore = explore = not self._explore
        gain = float(base_yield if base_yield is not None else len(candidates))
        tokens = base_tokens
        cost = self.cost.predict(tokens, num_rows)
        probs = [self.acceptance.probabilities(c.request_id) for c in candidates]
        # reach[j]: probability the request's next draft position is reached and accepted.
        heap = [(-probs[j][0], j) for j, c in enumerate(candidates) if c.max_k > 0]
        heapq.heapify(heap)
        reach = [1.0] * len(candidates)
        # Draft tokens in order of value; keep the prefix with the best rate, not the one where the
        # next token first fails to pay: step time is not convex in tokens (here the first draft of a
        # lone request adds ~30 ms to a 55 ms step, the next three ~10 ms together), so a token that
        # does not pay alone can open the way to ones that do.
        order: list[int] = []
        taken = [0] * len(candidates)
        best_gain, best_cost, best_len = gain, cost, 0
        while heap:
            neg_g, j = heapq.heappop(heap)
            g = -neg_g
            first = taken[j] == 0
            verify = (self.cost.pooled.min_slope if explore
                      else self.cost.draft_marginal(tokens, num_rows, first))
            marginal = verify + self.draft_cost_per_token
            order.append(j)
            tokens += 1
            gain += g
            cost += marginal
            reach[j] = g
            taken[j] += 1
            if gain * best_cost > best_gain * cost:  # a better rate than the best prefix so far
                best_gain, best_cost, best_len = gain, cost, len(order)
            if taken[j] < candidates[j].max_k:
                heapq.heappush(heap, (-(reach[j] * probs[j][taken[j]]), j))
        for j in order[:best_len]:
            ks[j] += 1
        gain, cost = best_gain, best_cost
        # Re-probe requests that have not drafted for a while, with one token: their estimate may be
        # stale (the text turned repetitive), and the step time at more tokens may be unknown yet. Not
        # when drafts sure to be accepted would still lower the step's rate at any K: then no estimate
        # can make drafting pay (a draft model as slow per token as the target: its own time matches
        # the step's rate, and verifying the draft comes on top). A probe that needs the proposer to
        # catch up (a draft model's prefill of everything since the request last drafted) costs a
        # prefill, not a token: at most one such probe per step, the others stay due (otherwise every
        # request of a c = 32 level comes due together, before the draft's cost is known, and each
        # prefills its whole context). The catch-up is not priced per token: a batched prefill costs
        # far less per token than drafting does.
        hopeless = self._hopeless(gain, cost, base_tokens, num_rows)
        # With gate_probes, a request that has been verified before is re-probed only while the method's
        # probes are accepted often enough to pay for one at this load (under load an assistant's probes
        # were accepted 1 time in 5 where 1 in 2 pays); a request never verified is probed whenever a sure
        # draft could pay. (For ngram the same gate cost 1-4% at 16-32 requests: its probes of requests
        # with a match find copied spans.)
        vain = False
        acc = self.acceptance
        if self.gate_probes and acc.probes_seen >= self.PROBE_MIN_SEEN and self.cost.measured(num_rows):
            price = self.cost.draft_marginal(base_tokens, num_rows, first=True) + self.draft_cost_per_token
            vain = acc.probe_yield * cost <= gain * price
        catch_up_probe = False
        for j in sorted(range(len(candidates)), key=lambda j: candidates[j].catch_up):
            c = candidates[j]
            if ks[j] > 0:
                self.acceptance.note_drafting(c.request_id)
                continue
            if c.max_k <= 0:
                continue
            heavy = c.catch_up > self.max_k + 1  # more than a verification's worth of tokens
            can_probe = not hopeless and not (heavy and catch_up_probe)
            if vain and acc.has_evidence(c.request_id):
                can_probe = False
            if self.acceptance.note_idle(c.request_id, can_probe=can_probe):
                ks[j] = 1
                catch_up_probe |= heavy
        return ks

    def _hopeless(self, gain: float, cost: float, tokens: int, num_rows: int | None) -> bool:
        """True when k drafts of one request, all accepted, lower the rate gain / cost for every k.
        Verification counts only once its price is measured at this request count: until then a probe is
        how it gets measured."""
        first = more = 0.0
        if self.cost.measured(num_rows):
            first = self.cost.draft_marginal(tokens, num_rows, first=True)
            more = self.cost.draft_marginal(tokens, num_rows)
        d = self.draft_cost_per_token
        return all(k * cost <= gain * (first + (k - 1) * more + k * d) for k in range(1, self.max_k + 1))

    def estimates(self) -> dict[str, float]:
        """Current cost-model terms, for the metrics gauges: one-token step, the marginal token at 8 and
        at 64 tokens, the proposer's time per drafted token, and the verification prices of a request's
        first draft token and of each further one at the last step's request count."""
        c, rows = self.cost, self._last_rows or 1
        return {"step_1_token_seconds": c.predict(1), "step_per_token_at_8_seconds": c.marginal(8),
                "step_per_token_at_64_seconds": c.marginal(64),
                "draft_per_token_seconds": self.draft_cost_per_token,
                "verify_first_draft_seconds": c.draft_marginal(rows, rows, first=True),
                "verify_further_draft_seconds": c.draft_marginal(rows, rows)}
