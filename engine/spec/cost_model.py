"""The adaptive controller's step cost model, learned online from decode/verify steps: step seconds by tokens
and request count, and draft-token prices (docs/speculative-decoding.md#adaptive-k)."""

from __future__ import annotations

import math


def _bucket(n: int) -> int:
    """Token and request counts are bucketed alike: exact up to 8, then powers of two."""
    return n if n <= 8 else 1 << (n - 1).bit_length()


class TokenCurve:
    """Step seconds by tokens: a smoothed point per token-count bucket, interpolated monotonely."""

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
            a = max(self.ema, 1.0 / (b[2] + 1))  # a mean for the first few, then an EMA
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
    """Draft prices at one request-count bucket: a recency-weighted least-squares fit of step-time changes
    = a + b * d(requests) + c1 * d(requests drafting) + c2 * d(draft tokens); a first draft costs c1 + c2."""

    def __init__(self, decay: float = 0.97, min_spread: float = 16.0,
                 min_request_spread: float = 8.0, split_only: bool = False) -> None:
        self.split_only = split_only
        self.decay = decay  # per informative pair: ~33 pairs of memory
        # Spread of draft-count (and drafting-request) changes: what c2 and c1 can be trusted on.
        self.min_spread = min_spread
        self.min_request_spread = min_request_spread
        self._xx = [[0.0] * 4 for _ in range(4)]
        self._xy = [0.0] * 4
        self._prev: tuple[tuple[float, float, float], float] | None = None
        self._fitted = False  # solve once per step, not per candidate
        self._prices: tuple[float, float] | None = None
        self._split: tuple[float, float] | None = None  # the last fit that told the prices apart

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
        """(first draft, each further one) in seconds; None until draft counts have varied enough."""
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
            # A first draft cheaper than the next, or a free further one, is noise.
        if self._split is not None:
            # Steady load cannot tell the prices apart: keep the last split.
            return self._split
        coef = self._lsq((0, 1, 3))
        # A negative price is noise, not free drafts.
        return None if coef is None or coef[2] <= 0 else (coef[2], coef[2])

    def _lsq(self, terms: tuple[int, ...]) -> list[float] | None:
        a = [[self._xx[i][j] for j in terms] for i in terms]
        # Ridge: a request count that never changed leaves its term all zeros.
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
    """Step seconds by tokens and requests: a `TokenCurve` and a `DraftPriceFit` per request-count bucket."""

    def __init__(self, prior: tuple[float, float] = (0.035, 0.007), ema: float = 0.2) -> None:
        self._prior, self._ema = prior, ema
        self.pooled = TokenCurve(prior, ema)
        self._by_rows: dict[int, TokenCurve] = {}
        self._draft_fit: dict[int, DraftPriceFit] = {}
        # Step pairs before a bucket's own fit counts: fewer have seen one K mix only.
        self.own_fit_steps = 6.0
        self._last_bucket: int | None = None  # the last step's bucket, for step pairs

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
        """A step the draft fits do not see (a prefill chunk) came between."""
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
        """Whether draft prices at this request count come from steps rather than a prior."""
        if num_rows:
            curve = self._by_rows.get(_bucket(num_rows))
            if self.draft_prices(num_rows) is not None:
                return True
            return curve is not None and len(curve.points()) >= 2
        return len(self.pooled.points()) >= 2

    def draft_marginal(self, num_tokens: float, num_rows: int | None = None, first: bool = False) -> float:
        """Seconds one more draft token adds at `num_rows` requests (`first`: the request's first draft)."""
        p = self.draft_prices(num_rows)
        if p is None:
            return self.marginal(num_tokens, num_rows)
        return max(p[0] if first else p[1], self.pooled.min_slope)

    def draft_price_unknown(self, num_rows: int | None) -> bool:
        """True where nothing measured prices a draft at this request count."""
        if not num_rows or self._settled_prices(num_rows) is not None:
            return False
        b = _bucket(num_rows)
        curve = self._by_rows.get(b)
        return not (b <= 8 and curve is not None and len(curve.points()) >= 2)

    def draft_prices(self, num_rows: int | None) -> tuple[float, float] | None:
        """The fitted (first, further) draft prices here, else the nearest settled bucket's within 2x."""
        if not num_rows:
            return None
        if num_rows == 1:
            # One request: only a fit that splits first from further drafts (one price would stop K at 1).
            fit = self._draft_fit.get(1)
            return fit.prices() if fit is not None else None
        settled = self._settled_prices(num_rows)
        if settled is not None:
            return settled
        fit = self._draft_fit.get(_bucket(num_rows))
        return fit.prices() if fit is not None else None

    def _settled_prices(self, num_rows: int) -> tuple[float, float] | None:
        """This bucket's prices once fitted on `own_fit_steps`, else the nearest settled within 2x."""
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
