"""Adaptive speculation (`"num_speculative_tokens": "auto"`): per request and step, the K (0 included) that
maximises the step's expected tokens per second (docs/speculative-decoding.md#adaptive-k)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from engine.sampling import TEMPERATURE_BUCKETS
from engine.spec.cost_model import StepCostModel

# Probability assumed for a position no request has reached yet.
_PRIOR_ACCEPT = 0.5
# Exploring steps price verification at nothing only for drafts this likely to be accepted.
_EXPLORE_MIN_REACH = 0.25
GREEDY = TEMPERATURE_BUCKETS[0]


@dataclass(slots=True)
class _BucketAcceptance:
    """Verdicts per position over every request of one temperature bucket: its new requests' prior."""
    hits: list[int]
    tries: list[int]


@dataclass(slots=True)
class _RequestAcceptance:
    p: list[float] = field(default_factory=list)  # P(accept position i | accepted 0..i-1)
    seen: list[int] = field(default_factory=list)  # times position i was verified for this request
    idle_steps: int = 0  # consecutive steps with K = 0
    probe_after: int = 0  # re-probe once idle this many steps (doubles per probe)
    probing: bool = False  # a probe is out and its verdict not back yet


class AcceptanceEstimator:
    def __init__(self, max_k: int, ema: float = 0.1, base_probe: int = 4, max_probe: int = 128,
                 prior_weight: float = 2.0) -> None:
        self.max_k = max_k
        self.ema = ema
        self.prior_weight = prior_weight
        self.base_probe = base_probe
        self.max_probe = max_probe
        # Running average per position and temperature bucket: new requests' prior.
        self._buckets: dict[str, _BucketAcceptance] = {}
        self._req: dict[str, _RequestAcceptance] = {}
        # Share of probes accepted: a running mean, then an EMA (weight 0.05).
        self.probe_yield = 0.0
        self.probes_seen = 0

    def _bucket(self, bucket: str) -> _BucketAcceptance:
        b = self._buckets.get(bucket)
        if b is None:
            b = self._buckets[bucket] = _BucketAcceptance([0] * self.max_k, [0] * self.max_k)
        return b

    def bucket_tries(self, bucket: str) -> int:
        """First-draft verdicts over every request of `bucket`."""
        return self._bucket(bucket).tries[0]

    def method_average(self, i: int, bucket: str = GREEDY) -> float:
        """The running average at position i over `bucket`'s requests (the flat prior before any)."""
        b = self._bucket(bucket)
        if b.tries[i]:
            return (b.hits[i] + _PRIOR_ACCEPT) / (b.tries[i] + 1)
            # A position nobody reached reads like the one before: a flat prior would keep K below it.
        return self.method_average(i - 1, bucket) if i > 0 else _PRIOR_ACCEPT

    def _state(self, request_id: str) -> _RequestAcceptance:
        st = self._req.get(request_id)
        if st is None:
            st = self._req[request_id] = _RequestAcceptance(
                p=[0.0] * self.max_k, seen=[0] * self.max_k, probe_after=self.base_probe)
        return st

    def probabilities(self, request_id: str, bucket: str = GREEDY) -> list[float]:
        """Per position: the request's own estimate, else its bucket's average, else one position back."""
        st = self._state(request_id)
        tries = self._bucket(bucket).tries
        out: list[float] = []
        for i in range(self.max_k):
            if st.seen[i]:
                out.append(st.p[i])
            elif tries[i] or i == 0:
                out.append(self.method_average(i, bucket))
            else:
                out.append(out[i - 1])
        return out

    def observe(self, request_id: str, num_drafts: int, num_accepted: int, bucket: str = GREEDY) -> None:
        """`num_drafts` verified, the first `num_accepted` accepted. The seed counts as `prior_weight`
        verdicts: a running mean first, then an EMA."""
        st = self._state(request_id)
        if st.probing and num_drafts > 0:
            st.probing = False
            self.probes_seen += 1
            a = max(0.05, 1.0 / self.probes_seen)
            self.probe_yield = (1 - a) * self.probe_yield + a * float(num_accepted > 0)
        prior = self.probabilities(request_id, bucket)
        b = self._bucket(bucket)
        for i in range(min(num_drafts, self.max_k)):
            if i > num_accepted:
                break  # later positions were never reached
            hit = 1.0 if i < num_accepted else 0.0
            if not st.seen[i]:
                st.p[i] = prior[i]
            st.seen[i] += 1
            a = max(self.ema, 1.0 / (st.seen[i] + self.prior_weight))
            st.p[i] = (1 - a) * st.p[i] + a * hit
            b.tries[i] += 1
            b.hits[i] += int(hit)
        if num_drafts > 0:
            st.idle_steps = 0

    def note_idle(self, request_id: str, can_probe: bool = True) -> bool:
        """Count a step without drafts; True when a probe is due (the next waits twice as long). With
        `can_probe` False it stays due."""
        st = self._state(request_id)
        st.idle_steps += 1
            # A probe never came back (preempted, or over the token budget): no verdict.
        st.probing = False
        if st.idle_steps < st.probe_after or not can_probe:
            return False
        st.probe_after = min(st.probe_after * 2, self.max_probe)
        st.probing = True
        return True

    def has_evidence(self, request_id: str) -> bool:
        return self._state(request_id).seen[0] > 0

    def note_drafting(self, request_id: str) -> None:
        """Drafts chosen on the estimate alone: probing starts over from the base wait."""
        st = self._state(request_id)
        st.probe_after = self.base_probe
        st.probing = False

    def release(self, request_id: str) -> None:
        self._req.pop(request_id, None)


@dataclass(slots=True)
class Candidate:
    request_id: str
    max_k: int  # what the request can take this step
    # Tokens the proposer processes before this request's first draft (a draft model's KV behind).
    catch_up: int = 0
    bucket: str = GREEDY  # engine.sampling.temperature_bucket


class AdaptiveController:
    PROBE_MIN_SEEN = 16  # probes back before their yield may stop re-probing
    BUCKET_MIN_SEEN = 32  # a bucket's first-draft verdicts before its average may stop probes

    def __init__(self, max_k: int, ema: float = 0.1, base_probe: int = 4, gate_probes: bool = False) -> None:
        self.max_k = max_k
        # Model drafts re-probe only while probes pay; lookups' probes find copied spans.
        self.gate_probes = gate_probes
        self.cost = StepCostModel()
        self.acceptance = AcceptanceEstimator(max_k, ema=ema, base_probe=base_probe)
        self.draft_cost_per_token = 0.0  # seconds per drafted token (EMA)
        self._draft_seen = False
        self._last_rows: int | None = None  # requests in the last step chosen for (the gauges)
        self._explore = False  # flips each step at a request count with no draft price yet

    # -- observations ----------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float, num_rows: int | None = None,
                     num_drafting: int | None = None) -> None:
        self.cost.observe(num_tokens, seconds, num_rows, num_drafting)

    def skip_step(self) -> None:
        """A step that is not decode/verify ran: price pairs must not span it."""
        self.cost.interrupt()

    def observe_draft(self, num_draft_tokens: int, seconds: float) -> None:
        if num_draft_tokens <= 0:
            return
        per = seconds / num_draft_tokens
        seen = self._draft_seen
        self.draft_cost_per_token = 0.8 * self.draft_cost_per_token + 0.2 * per if seen else per
        self._draft_seen = True

    def observe_verification(self, request_id: str, num_drafts: int, num_accepted: int,
                             bucket: str = GREEDY) -> None:
        self.acceptance.observe(request_id, num_drafts, num_accepted, bucket)

    def release(self, request_id: str) -> None:
        self.acceptance.release(request_id)

    # -- the choice ------------------------------------------------------------------------------
    def choose(self, candidates: list[Candidate], base_tokens: int, base_yield: int | None = None,
               num_rows: int | None = None) -> list[int]:
        """K per candidate for the next step. `base_tokens`/`base_yield`: tokens the step computes/emits
        without drafts; `num_rows`: requests in the step (None: the pooled cost curve)."""
        if not candidates:
            return []
        self._last_rows = num_rows
        # With no draft price at this request count, every other step explores (spread for the fit).
        explore = False
        if self.cost.draft_price_unknown(num_rows):
            self._explore = explore = not self._explore
        gain = float(base_yield if base_yield is not None else len(candidates))
        ks, gain, cost = self._best_prefix(candidates, base_tokens, gain, num_rows, explore)
        self._reprobe(candidates, ks, base_tokens, num_rows, gain, cost)
        return ks

    def _best_prefix(self, candidates: list[Candidate], tokens: int, gain: float, num_rows: int | None,
                     explore: bool) -> tuple[list[int], float, float]:
        """K per candidate: the prefix of the draft tokens ranked by acceptance probability with the best
        rate, with its expected tokens and predicted seconds."""
        cost = self.cost.predict(tokens, num_rows)
        probs = [self.acceptance.probabilities(c.request_id, c.bucket) for c in candidates]
        # reach[j]: probability the next draft position is reached and accepted.
        heap = [(-probs[j][0], j) for j, c in enumerate(candidates) if c.max_k > 0]
        heapq.heapify(heap)
        reach = [1.0] * len(candidates)
        # The best-rate prefix: step time is not convex in tokens.
        order: list[int] = []
        taken = [0] * len(candidates)
        best_gain, best_cost, best_len = gain, cost, 0
        while heap:
            neg_g, j = heapq.heappop(heap)
            g = -neg_g
            first = taken[j] == 0
            verify = (self.cost.pooled.min_slope if explore and g >= _EXPLORE_MIN_REACH
                      else self.cost.draft_marginal(tokens, num_rows, first))
            marginal = verify + self.draft_cost_per_token
            order.append(j)
            tokens += 1
            gain += g
            cost += marginal
            reach[j] = g
            taken[j] += 1
            if gain * best_cost > best_gain * cost:
                best_gain, best_cost, best_len = gain, cost, len(order)
            if taken[j] < candidates[j].max_k:
                heapq.heappush(heap, (-(reach[j] * probs[j][taken[j]]), j))
        ks = [0] * len(candidates)
        for j in order[:best_len]:
            ks[j] += 1
        return ks, best_gain, best_cost

    def _reprobe(self, candidates: list[Candidate], ks: list[int], base_tokens: int, num_rows: int | None,
                 gain: float, cost: float) -> None:
        """One probe token for each idle request due one (sets its ks entry)."""
        # Verification prices count once measured at this request count: until then probes measure them.
        measured = self.cost.measured(num_rows)
        first = self.cost.draft_marginal(base_tokens, num_rows, first=True) if measured else 0.0
        more = self.cost.draft_marginal(base_tokens, num_rows) if measured else 0.0
        hopeless = self._hopeless(gain, cost, first, more)
        acc = self.acceptance
        # gate_probes: requests verified before are probed only while probes pay at this load.
        vain = (self.gate_probes and measured and acc.probes_seen >= self.PROBE_MIN_SEEN
                and acc.probe_yield * cost <= gain * (first + self.draft_cost_per_token))
        # Sampled requests: only where drafts at their bucket's averages could pay.
        vain_bucket: dict[str, bool] = {}
        catch_up_probe = False  # a catch-up probe costs a prefill: one per step
        for j in sorted(range(len(candidates)), key=lambda j: candidates[j].catch_up):
            c = candidates[j]
            if ks[j] > 0:
                acc.note_drafting(c.request_id)
                continue
            if c.max_k <= 0:
                continue
            if c.bucket != GREEDY and not hopeless and measured and c.bucket not in vain_bucket:
                vain_bucket[c.bucket] = (acc.bucket_tries(c.bucket) >= self.BUCKET_MIN_SEEN
                                         and self._hopeless(gain, cost, first, more, c.bucket))
            heavy = c.catch_up > self.max_k + 1  # more than a verification's tokens
            can_probe = (not hopeless and not vain_bucket.get(c.bucket, False)
                         and not (heavy and catch_up_probe))
            if vain and acc.has_evidence(c.request_id):
                can_probe = False
            if acc.note_idle(c.request_id, can_probe=can_probe):
                ks[j] = 1
                catch_up_probe |= heavy

    def drafting_hopeless(self, num_rows: int | None) -> bool:
        """True when measured prices say no K can pay even for sure drafts: the proposer is skipped."""
        if not self.cost.measured(num_rows) or self.cost.draft_price_unknown(num_rows):
            return False
        tokens = num_rows or 1
        first = self.cost.draft_marginal(tokens, num_rows, first=True)
        more = self.cost.draft_marginal(tokens, num_rows)
        return self._hopeless(float(tokens), self.cost.predict(tokens, num_rows), first, more)

    def _hopeless(self, gain: float, cost: float, first: float, more: float,
                  bucket: str | None = None) -> bool:
        """True when k drafts lower the rate for every k, all accepted (or, with `bucket`, at its averages);
        `first`, `more`: verification prices of the first draft token and of each further one."""
        d = self.draft_cost_per_token
        expected, reach = 0.0, 1.0
        for k in range(1, self.max_k + 1):
            if bucket is not None:
                reach *= self.acceptance.method_average(k - 1, bucket)
            expected += reach
            if expected * cost > gain * (first + (k - 1) * more + k * d):
                return False
        return True

    def estimates(self) -> dict[str, float]:
        """The cost model's terms for the gauges (docs/monitoring.md), at the last step's request count."""
        c, rows = self.cost, self._last_rows or 1
        return {"step_1_token_seconds": c.predict(1), "step_per_token_at_8_seconds": c.marginal(8),
                "step_per_token_at_64_seconds": c.marginal(64),
                "draft_per_token_seconds": self.draft_cost_per_token,
                "verify_first_draft_seconds": c.draft_marginal(rows, rows, first=True),
                "verify_further_draft_seconds": c.draft_marginal(rows, rows)}
