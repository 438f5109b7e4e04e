"""Adaptive speculation (`"num_speculative_tokens": "auto"`): each step, per request, pick the number
of draft tokens (0 included) that maximises expected tokens per second of the whole step.

Inputs, all learned online from the engine's own measurements:
- `StepCostModel` (engine/spec/cost_model.py): target step seconds as a function of the step's tokens
  at its number of requests, and the prices of a request's first draft token and of each further one
  (where none is known yet, every other step explores);
- draft cost per drafted token (the proposer's own time: ~0 for ngram/suffix, a draft forward for
  draft_model), an exponential moving average;
- `AcceptanceEstimator`: per request and per position, the probability that the draft at position i is
  accepted given the ones before were, smoothed (EMA) and seeded by the running average of the requests
  of its temperature bucket (greedy drafts are accepted far more often than sampled ones).
Requests that stop drafting are re-probed with one token after a doubling number of idle steps (for
model drafts, once verified, only while the method's probes are accepted often enough to pay).

Allocation ranks draft tokens by value (the probability g that each is reached and accepted) and
keeps the prefix of that ranking with the best rate G / C (expected tokens over predicted step
seconds, one more verified token plus its draft per draft token). Under load (large C, large G) only
confident drafts make the rate grow; at batch 1 with cheap verification most do. Pure Python.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from engine.sampling import TEMPERATURE_BUCKETS
from engine.spec.cost_model import StepCostModel

# Probability assumed for a position the request has never reached (before any average of its bucket).
_PRIOR_ACCEPT = 0.5
# An exploring step takes at no verification price only draft tokens at least this likely to be reached
# and accepted: a K spread for the fit where drafts are often right (greedy, copied text), not sampled
# requests' deep drafts, which cost a whole row each and are rarely accepted.
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
        # Running average per position and temperature bucket: seeds new requests of that bucket.
        self._buckets: dict[str, _BucketAcceptance] = {}
        self._req: dict[str, _RequestAcceptance] = {}
        # Share of probes accepted, over all requests: a running mean, then a moving average (weight 0.05).
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
        """The method's running average at position i over the requests of `bucket` (a bucket no request
        has drafted in yet starts from the flat prior, not from the other buckets' average)."""
        b = self._bucket(bucket)
        if b.tries[i]:
            return (b.hits[i] + _PRIOR_ACCEPT) / (b.tries[i] + 1)
        # A position no request has reached yet: like the one before it, not a flat prior that would
        # keep K below it for good.
        return self.method_average(i - 1, bucket) if i > 0 else _PRIOR_ACCEPT

    def _state(self, request_id: str) -> _RequestAcceptance:
        st = self._req.get(request_id)
        if st is None:
            st = self._req[request_id] = _RequestAcceptance(
                p=[0.0] * self.max_k, seen=[0] * self.max_k, probe_after=self.base_probe)
        return st

    def probabilities(self, request_id: str, bucket: str = GREEDY) -> list[float]:
        """Per position: the request's own estimate where it has evidence; else the running average of
        its temperature bucket, read now (not frozen at admission); else the request's estimate one
        position back."""
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
        """A verification of `num_drafts` drafts accepted the first `num_accepted`, for a request of
        temperature bucket `bucket`.

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
        prior = self.probabilities(request_id, bucket)
        b = self._bucket(bucket)
        for i in range(min(num_drafts, self.max_k)):
            if i > num_accepted:
                break  # later positions were never reached: no evidence about them
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
        """Count a step without drafts; True when the request is due a probe (the next one then waits
        twice as long, until the request drafts by choice again). With `can_probe` False a due request
        stays due for a later step."""
        st = self._state(request_id)
        st.idle_steps += 1
        # A probe still open here never came back (its draft was dropped: preemption, or the step's token
        # budget): a later verification must not count as its verdict.
        st.probing = False
        if st.idle_steps < st.probe_after or not can_probe:
            return False
        st.probe_after = min(st.probe_after * 2, self.max_probe)
        st.probing = True
        return True

    def has_evidence(self, request_id: str) -> bool:
        return self._state(request_id).seen[0] > 0

    def note_drafting(self, request_id: str) -> None:
        """The controller chose drafts on the estimate alone: probing starts over from the base wait, and
        their verdict is no probe's."""
        st = self._state(request_id)
        st.probe_after = self.base_probe
        st.probing = False

    def release(self, request_id: str) -> None:
        self._req.pop(request_id, None)


@dataclass(slots=True)
class Candidate:
    request_id: str
    max_k: int  # what the request can take this step (length limits, static caps)
    # Tokens the proposer must process before this request's first draft (a draft model whose KV
    # fell behind while the request did not draft); 0 for proposers without per-request state.
    catch_up: int = 0
    bucket: str = GREEDY  # the request's temperature bucket (engine.sampling.temperature_bucket)


class AdaptiveController:
    PROBE_MIN_SEEN = 16  # probes back before their yield may stop re-probing
    BUCKET_MIN_SEEN = 32  # a temperature bucket's first-draft verdicts before its average may stop probes

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

    def observe_verification(self, request_id: str, num_drafts: int, num_accepted: int,
                             bucket: str = GREEDY) -> None:
        self.acceptance.observe(request_id, num_drafts, num_accepted, bucket)

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
        # nothing (the proposer's own time still counts) for drafts likely to be accepted: steps with and
        # without drafts side by side give the fit its spread within a few steps, and the other steps keep
        # the curve's guess.
        explore = False
        if self.cost.draft_price_unknown(num_rows):
            self._explore = explore = not self._explore
        gain = float(base_yield if base_yield is not None else len(candidates))
        tokens = base_tokens
        cost = self.cost.predict(tokens, num_rows)
        probs = [self.acceptance.probabilities(c.request_id, c.bucket) for c in candidates]
        # reach[j]: probability the request's next draft position is reached and accepted.
        heap = [(-probs[j][0], j) for j, c in enumerate(candidates) if c.max_k > 0]
        heapq.heapify(heap)
        reach = [1.0] * len(candidates)
        # Draft tokens in order of value; keep the prefix with the best rate, not the one where the
        # next token first fails to pay: step time is not convex in tokens (a lone request's first draft
        # costs far more than the ones after it), so a token that does not pay alone can open the way
        # to ones that do.
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
        # Verification prices count only once measured at this request count: until then a probe is how
        # they get measured.
        measured = self.cost.measured(num_rows)
        first = self.cost.draft_marginal(base_tokens, num_rows, first=True) if measured else 0.0
        more = self.cost.draft_marginal(base_tokens, num_rows) if measured else 0.0
        hopeless = self._hopeless(gain, cost, first, more)
        # With gate_probes, a request that has been verified before is re-probed only while the method's
        # probes are accepted often enough to pay for one at this load (under load an assistant's probes
        # mostly fail and cost more than they win); a request never verified is probed whenever a sure
        # draft could pay. (Not for ngram: its probes of requests with a match find copied spans, and the
        # gate lost it throughput under load.)
        acc = self.acceptance
        vain = (self.gate_probes and measured and acc.probes_seen >= self.PROBE_MIN_SEEN
                and acc.probe_yield * cost <= gain * (first + self.draft_cost_per_token))
        # A sampled request is probed only where drafts accepted at its temperature bucket's running
        # averages could pay: a sampled draft is accepted with the target's probability of it, so the
        # bucket's average is what a probe can hope for, and under load probes on a sure draft's hope cost
        # throughput for nothing. Greedy requests keep the sure-draft rule: their probes find copied spans,
        # which are accepted whole. Not on a bucket's first few verdicts: two early misses would stop its
        # probes, and with them the verdicts that could lift its average, for good.
        vain_bucket: dict[str, bool] = {}
        catch_up_probe = False
        for j in sorted(range(len(candidates)), key=lambda j: candidates[j].catch_up):
            c = candidates[j]
            if ks[j] > 0:
                self.acceptance.note_drafting(c.request_id)
                continue
            if c.max_k <= 0:
                continue
            if c.bucket != GREEDY and not hopeless and measured and c.bucket not in vain_bucket:
                vain_bucket[c.bucket] = (acc.bucket_tries(c.bucket) >= self.BUCKET_MIN_SEEN
                                         and self._hopeless(gain, cost, first, more, c.bucket))
            heavy = c.catch_up > self.max_k + 1  # more than a verification's worth of tokens
            can_probe = (not hopeless and not vain_bucket.get(c.bucket, False)
                         and not (heavy and catch_up_probe))
            if vain and acc.has_evidence(c.request_id):
                can_probe = False
            if self.acceptance.note_idle(c.request_id, can_probe=can_probe):
                ks[j] = 1
                catch_up_probe |= heavy
        return ks

    def drafting_hopeless(self, num_rows: int | None) -> bool:
        """True when measured prices at this request count (None: the pooled curve, a step of one token)
        say that drafts sure to be accepted would lower a step's rate at every K: no choice, probe
        included, can draft, so the engine skips the proposer (its lookups cost ~4-7% of a 4-bit step at
        8 sampled requests, for nothing)."""
        if not self.cost.measured(num_rows) or self.cost.draft_price_unknown(num_rows):
            return False
        tokens = num_rows or 1
        first = self.cost.draft_marginal(tokens, num_rows, first=True)
        more = self.cost.draft_marginal(tokens, num_rows)
        return self._hopeless(float(tokens), self.cost.predict(tokens, num_rows), first, more)

    def _hopeless(self, gain: float, cost: float, first: float, more: float,
                  bucket: str | None = None) -> bool:
        """True when k drafts of one request lower the rate gain / cost for every k (`first`, `more`:
        verification prices of its first draft token and of each further one): drafts all accepted, or
        with `bucket`, accepted at that bucket's running averages."""
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
        """Current cost-model terms, for the metrics gauges: one-token step, the marginal token at 8 and
        at 64 tokens, the proposer's time per drafted token, and the verification prices of a request's
        first draft token and of each further one at the last step's request count."""
        c, rows = self.cost, self._last_rows or 1
        return {"step_1_token_seconds": c.predict(1), "step_per_token_at_8_seconds": c.marginal(8),
                "step_per_token_at_64_seconds": c.marginal(64),
                "draft_per_token_seconds": self.draft_cost_per_token,
                "verify_first_draft_seconds": c.draft_marginal(rows, rows, first=True),
                "verify_further_draft_seconds": c.draft_marginal(rows, rows)}
