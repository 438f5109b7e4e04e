"""Adaptive speculation: the controller on synthetic costs and acceptances, then `"auto"` through the real
engine (greedy output exact, metrics exposed)."""

from __future__ import annotations

import random

import pytest

from engine.sampling import SamplingParams, temperature_bucket
from engine.spec.adaptive import GREEDY, AcceptanceEstimator, AdaptiveController, Candidate


def controller(fixed: float, per_token: float, accept: float, max_k: int = 8, draft: float = 0.0,
               requests: int = 1) -> tuple[AdaptiveController, list[Candidate]]:
    """A controller that has seen a perfectly linear machine and `requests` requests whose drafts are
    each accepted with probability `accept` (independently per position, stopping at the first miss)."""
    c = AdaptiveController(max_k, ema=0.02)  # slow EMA: the estimate settles on the true rate
    for n in (1, 2, 4, 8, 16, 32):
        for _ in range(3):
            c.observe_step(n, fixed + per_token * n)
    if draft:
        c.observe_draft(10, 10 * draft)
    rng = random.Random(0)
    cands = [Candidate(f"r{i}", max_k) for i in range(requests)]
    for cand in cands:
        for _ in range(400):
            accepted = 0
            while accepted < max_k and rng.random() < accept:
                accepted += 1
            c.observe_verification(cand.request_id, max_k, accepted)
    return c, cands


def test_acceptance_estimate_is_per_position_and_conditional() -> None:
    est = AcceptanceEstimator(max_k=4, ema=0.5)
    for _ in range(10):
        est.observe("a", 4, 1)  # position 0 always accepted, position 1 always rejected
    p = est.probabilities("a")
    assert p[0] > 0.99 and p[1] < 0.01
    assert p[2] == p[1] and p[3] == p[1]  # never reached by anyone: like the position before it
    # A new request starts from the method's running averages, not from scratch.
    fresh = est.probabilities("b")
    assert fresh[0] > 0.9 and fresh[1] < 0.1 and fresh[2] == fresh[1]
    # Another request reaches position 2 and is always right there: "a", which never reached it, now
    # reads the method's average (live, not frozen when "a" was admitted); its own evidence stays.
    for _ in range(10):
        est.observe("c", 4, 3)
    p = est.probabilities("a")
    assert p[2] > 0.9 and p[1] < 0.01


def test_picks_zero_when_drafting_cannot_pay() -> None:
    # Verification costs as much per token as a whole step and drafts are mostly wrong.
    c, cands = controller(fixed=0.010, per_token=0.030, accept=0.1)
    assert c.choose(cands, base_tokens=1) == [0]
    # A draft model as expensive as the target (self-draft on a CPU) never pays, even when always right.
    c, cands = controller(fixed=0.035, per_token=0.007, accept=1.0, draft=0.041)
    assert c.choose(cands, base_tokens=1) == [0]


def test_picks_the_largest_k_when_acceptance_is_one_and_verification_nearly_free() -> None:
    c, cands = controller(fixed=0.040, per_token=0.0001, accept=1.0, max_k=6)
    assert c.choose(cands, base_tokens=1) == [6]


def test_moves_with_load_and_with_acceptance() -> None:
    # Same machine, same 0.75 acceptance: drafts at batch 1, stops drafting at batch 32.
    c, one = controller(fixed=0.035, per_token=0.007, accept=0.75, max_k=4)
    k1 = c.choose(one, base_tokens=1)[0]
    c32, many = controller(fixed=0.035, per_token=0.007, accept=0.75, max_k=4, requests=32)
    k32 = c32.choose(many, base_tokens=32)
    assert k1 >= 2 and sum(k32) < k1 * 32 / 4
    # Acceptance collapses for one request: its K falls to 0 while the other keeps drafting.
    c, two = controller(fixed=0.035, per_token=0.007, accept=0.9, max_k=4, requests=2)
    for _ in range(150):
        c.observe_verification("r1", 4, 0)
    ks = c.choose(two, base_tokens=2)
    assert ks[0] >= 2 and ks[1] == 0


def simulate(conc: int, accept: float, steps: int, k: int | None = None) -> tuple[float, float]:
    """A cold controller (or static K) on a concave CPU-like machine, t(n) = 41 ms * n^0.33:
    (tokens per second, mean K over the last half)."""
    rng = random.Random(1)
    c = AdaptiveController(4)
    cands = [Candidate(f"r{i}", 4) for i in range(conc)]
    toks, secs, late_k = 0, 0.0, []
    for step in range(steps):
        ks = c.choose(cands, conc) if k is None else [k] * conc
        n = conc + sum(ks)
        dt = 0.041 * n ** 0.33 * rng.uniform(0.9, 1.1)
        c.observe_step(n, dt)
        secs += dt
        for cand, kk in zip(cands, ks, strict=True):
            a = 0
            while a < kk and rng.random() < accept:
                a += 1
            c.observe_verification(cand.request_id, kk, a)
            toks += 1 + a
        if step >= steps // 2:
            late_k.append(sum(ks) / conc)
    return toks / secs, sum(late_k) / len(late_k)


@pytest.mark.parametrize("conc", [1, 8, 32])
def test_learns_from_cold_to_near_the_best_static_k(conc: int) -> None:
    # Nothing known at the start (prior cost line, prior acceptance): it must explore its way to K near 4
    # where drafts are nearly always right, and stay near 0 where they rarely are.
    for accept, lo, hi in ((0.9, 3.0, 4.0), (0.2, 0.0, 0.6)):
        tput, mean_k = simulate(conc, accept, 200)
        best = max(simulate(conc, accept, 200, k)[0] for k in (0, 1, 2, 4))
        assert lo <= mean_k <= hi and tput >= 0.93 * best, (accept, mean_k, tput / best)


def test_requests_that_cannot_draft_still_count_in_the_step_rate() -> None:
    # 8 decoding requests, 4 of them greedy: the 4 sampled ones also emit a token per step, so the
    # step's rate is higher and drafts must clear a higher bar than with 4 requests alone.
    c, greedy = controller(fixed=0.035, per_token=0.007, accept=0.6, max_k=4, requests=4)
    alone = c.choose(greedy, base_tokens=8, base_yield=4)
    mixed = c.choose(greedy, base_tokens=8, base_yield=8)
    assert sum(mixed) < sum(alone) and all(m <= a for m, a in zip(mixed, alone, strict=True))


def test_idle_request_is_reprobed_with_backoff() -> None:
    c, _ = controller(fixed=0.035, per_token=0.007, accept=0.0, max_k=4)
    new = [Candidate("new", 4)]  # starts from the method's average: drafts never pay
    probes = []
    for step in range(100):
        k = c.choose(new, base_tokens=1)[0]
        if k:
            probes.append(step)
            c.observe_verification("new", k, 0)  # each probe fails
    assert len(probes) >= 2
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # waits grow after repeated failures


def test_a_good_request_after_bad_ones_drafts_again_within_its_output() -> None:
    # The method's average is low (free-form requests before it); this request copies its prompt and
    # every draft it is given is right. Its probes must lift its estimate fast enough that it drafts by
    # choice well within a 64-token output, not after ten probes at doubling intervals.
    c, _ = controller(fixed=0.035, per_token=0.007, accept=0.0, max_k=4, requests=0)
    rng = random.Random(1)
    for i in range(400):  # a first draft right 1 time in 10; once right, the next ones mostly are
        accepted = 0 if rng.random() > 0.1 else sum(1 for _ in range(3) if rng.random() < 0.8) + 1
        c.observe_verification(f"bad{i % 8}", 4, accepted)
    good = [Candidate("good", 4)]
    drafted = []
    for _ in range(64):
        k = c.choose(good, base_tokens=1)[0]
        if k:
            c.observe_verification("good", k, k)
        drafted.append(k)
    assert drafted[0] == 0  # seeded by the bad requests: no drafts on the estimate alone
    assert sum(drafted[:24]) >= 12 and all(k >= 2 for k in drafted[32:])


def test_no_probes_when_even_sure_drafts_cannot_pay() -> None:
    # The target as its own draft on a CPU: always accepted, but a draft token costs about what the
    # step makes per token (41 vs 42 ms), and verifying it comes on top: no K can pay, so no probes.
    # (Before verification counted here, such probes went on at doubling intervals for good, and at
    # every new request count the server drafted: 0.81x of `off` at c = 8.)
    c, cands = controller(fixed=0.035, per_token=0.007, accept=1.0, max_k=4, draft=0.041)
    assert all(c.choose(cands, base_tokens=1) == [0] for _ in range(200))
    # A draft slower per token than the whole step: no probe either.
    c, cands = controller(fixed=0.035, per_token=0.007, accept=1.0, max_k=4, draft=0.050)
    assert all(c.choose(cands, base_tokens=1) == [0] for _ in range(50))
    # A draft that leaves room for its verification (30 + 7 ms < 42 ms per token): drafting pays.
    c, cands = controller(fixed=0.035, per_token=0.007, accept=1.0, max_k=4, draft=0.030)
    assert c.choose(cands, base_tokens=1)[0] >= 1
    # Cheap drafts with the same history are taken at once.
    c, cands = controller(fixed=0.035, per_token=0.007, accept=1.0, max_k=4, draft=0.0005)
    assert c.choose(cands, base_tokens=1) == [4]


def _probes(bucket: str, first: float, later: float, earlier: int = 400) -> int:
    """Drafts chosen over 40 steps for 8 requests of `bucket` on a machine like this one at 4 bits (a step
    25 ms, a request's first draft 5.7 ms, each further one 2 ms), after `earlier` verifications of the
    bucket's earlier requests (first drafts accepted with probability `first`, later ones `later`) and one
    rejected first draft of each of the 8."""
    c = AdaptiveController(4, ema=0.02)
    rng = random.Random(0)
    for _ in range(60):  # steps at 8 requests with varied drafting: the fit settles on the prices
        drafting = rng.randint(0, 4)
        drafts = drafting + sum(rng.randint(0, 3) for _ in range(drafting))
        c.observe_step(8 + drafts, 0.025 + 0.0037 * drafting + 0.002 * drafts, num_rows=8,
                       num_drafting=drafting)
    for i in range(earlier):
        accepted = int(rng.random() < first)
        while 0 < accepted < 4 and rng.random() < later:
            accepted += 1
        c.observe_verification(f"old{i}", 4, accepted, bucket=bucket)
    cands = [Candidate(f"r{i}", 4, bucket=bucket) for i in range(8)]
    for cand in cands:  # each request's own first draft was rejected
        c.observe_verification(cand.request_id, 1, 0, bucket=bucket)
    return sum(sum(c.choose(cands, base_tokens=8, num_rows=8)) for _ in range(40))


def test_sampled_requests_are_not_probed_where_their_buckets_acceptance_cannot_pay() -> None:
    # Four sure drafts would pay (4 tokens for 11.7 ms against 3.1 ms a token), so greedy requests are
    # re-probed; sampled ones, whose bucket accepts 6 first drafts in 10 and a quarter of the later ones,
    # could not gain (at most 0.75 tokens for 7.7 ms), and are not, unless their bucket's drafts are all
    # accepted.
    assert _probes("(0.5,1]", 0.6, 0.25) == 0
    assert _probes(GREEDY, 0.6, 0.25) > 0  # greedy: the sure-draft rule
    assert _probes("(0.5,1]", 1.0, 1.0) > 0  # a sampled bucket whose drafts are all accepted: probed


def test_a_sampled_buckets_first_misses_do_not_stop_its_probes() -> None:
    # The same prices with a bucket that has seen only its 8 requests' first drafts, all rejected: its
    # average says no draft can pay, but on 8 verdicts, so probes go on until it has enough of them (a
    # single stream otherwise stopped drafting for a whole run after two early misses).
    assert _probes("(0.5,1]", 0.6, 0.25, earlier=0) > 0
    n = AdaptiveController.BUCKET_MIN_SEEN
    assert _probes("(0.5,1]", 0.0, 0.0, earlier=n) == 0  # enough misses: no probes


def test_hopeless_drafting_is_known_before_any_lookup() -> None:
    """Where even sure drafts cannot pay at a request count, the controller says so from its prices alone
    (the engine then skips the proposer); not before those prices are measured, and not where drafts pay."""
    c, cands = controller(fixed=0.035, per_token=0.007, accept=1.0, max_k=4, draft=0.041)
    assert c.drafting_hopeless(None)
    assert all(c.choose(cands, base_tokens=1) == [0] for _ in range(20))  # what choose() says too
    c, _ = controller(fixed=0.035, per_token=0.007, accept=1.0, max_k=4, draft=0.0005)
    assert not c.drafting_hopeless(None)
    assert not AdaptiveController(4).drafting_hopeless(None)  # nothing measured yet
    assert not AdaptiveController(4).drafting_hopeless(8)


def test_the_engine_skips_the_proposer_while_drafting_is_hopeless() -> None:
    """The engine asks before looking drafts up: while hopeless, the proposer is not called and nothing is
    drafted, and output stays plain decoding's."""
    from tests.helpers import make_llm
    from tests.spec.test_spec import GREEDY, assert_pool_full, prompts

    plain = make_llm()
    llm = make_llm(speculative_config=AUTO["ngram"])
    spec = llm.core.speculation
    calls: list[int] = []
    original = spec.proposer.propose
    spec.proposer.propose = lambda reqs: calls.append(len(reqs)) or original(reqs)  # type: ignore[method-assign]
    spec.adaptive.drafting_hopeless = lambda rows: True  # type: ignore[method-assign]
    ps = [llm.encode(p) for p in prompts()[-3:]]
    outs = llm.generate(ps, GREEDY)
    assert calls == [] and sum(o.spec_num_draft_tokens for o in outs) == 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(ps, GREEDY)]
    assert_pool_full(llm)
    # Without the verdict the same requests do look drafts up.
    spec.adaptive.drafting_hopeless = lambda rows: False  # type: ignore[method-assign]
    llm.generate(ps, GREEDY)
    assert calls


def test_probes_stop_where_their_yield_cannot_pay() -> None:
    # 32 requests whose drafts are accepted 1 time in 5; at 32 rows a token is worth 8.1 ms and a draft
    # costs 7 ms to verify, so only a request accepted ~9 times in 10 would pay. The first wave of probes
    # is sent (a sure draft could pay); once their yield is known, requests already verified are not
    # probed again at this load, a new request still gets its first probe, and at one request (a token
    # worth 42 ms) the yield pays and probing resumes.
    def waves(gate: bool) -> tuple[AdaptiveController, list[Candidate], list[int]]:
        c, cands = controller(fixed=0.035, per_token=0.007, accept=0.2, max_k=4, requests=32)
        c.gate_probes = gate
        rng = random.Random(3)
        probed: list[int] = []
        for _ in range(120):
            ks = c.choose(cands, base_tokens=32)
            probed.append(sum(1 for k in ks if k))
            for cand, k in zip(cands, ks, strict=True):
                if k:
                    c.observe_verification(cand.request_id, k, int(rng.random() < 0.2))
        return c, cands, probed

    # Lookups (no gate): the doubling alone sends waves at steps 3, 11, 27 and 59.
    assert [i for i, n in enumerate(waves(False)[2]) if n == 32] == [3, 11, 27, 59]
    c, cands, probed = waves(True)
    assert c.acceptance.probes_seen >= 16 and c.acceptance.probe_yield < 0.5
    assert probed[3] == 32 and sum(probed[4:]) == 0
    new = [*cands, Candidate("new", 4)]
    assert any(c.choose(new, base_tokens=33)[-1] for _ in range(8))
    alone = [cands[0]]
    assert any(c.choose(alone, base_tokens=1)[0] for _ in range(200))


def test_a_dropped_probe_has_no_verdict() -> None:
    # A probe whose draft never reaches verification (the request was preempted, or its drafts did not fit
    # the step's budget) must not take the verdict of the request's next drafts, chosen on the estimate:
    # the probe yield would read the chosen drafts' acceptance, which is what gating probes must not see.
    def probe(est: AcceptanceEstimator) -> None:
        assert [est.note_idle("r") for _ in range(4)] == [False, False, False, True]

    for then_chosen in (False, True):
        est = AcceptanceEstimator(max_k=4, base_probe=4)
        probe(est)
        if then_chosen:
            est.note_drafting("r")  # next step the controller drafts for it by choice
        else:
            assert not est.note_idle("r")  # next step it idles (the next probe is 8 idle steps away)
        est.observe("r", 3, 3)
        assert est.probes_seen == 0 and est.probe_yield == 0.0
    # A probe that does come back is counted.
    est = AcceptanceEstimator(max_k=4, base_probe=4)
    probe(est)
    est.observe("r", 1, 1)
    assert est.probes_seen == 1 and est.probe_yield == 1.0


def test_probes_that_need_a_catch_up_go_one_per_step() -> None:
    # 8 idle requests come due together. Free probes (ngram, MTP) all go at once; probes that make a
    # draft model prefill everything since the request last drafted go one per step, the rest stay due.
    # (Unit costs as in a CPU step: 35 ms + 7 ms per token, the draft unseen so far.)
    def due_probes(catch_up: int) -> list[int]:
        c, _ = controller(fixed=0.035, per_token=0.007, accept=0.0, max_k=4)
        cands = [Candidate(f"n{i}", 4, catch_up) for i in range(8)]
        counts = []
        for _ in range(12):
            ks = c.choose(cands, base_tokens=8)
            counts.append(sum(ks))
            for cand, k in zip(cands, ks, strict=True):
                if k:
                    c.observe_verification(cand.request_id, k, 0)
        return counts

    free, heavy = due_probes(0), due_probes(200)
    assert max(free) == 8 and max(heavy) == 1
    assert sum(heavy) >= 4  # the others were kept due, not dropped
    # A draft known to cost more per token than the step's rate: no probe, caught up or not.
    c, _ = controller(fixed=0.035, per_token=0.007, accept=0.0, max_k=4, draft=0.050)
    assert all(c.choose([Candidate("behind", 4, 200), Candidate("current", 4, 1)], base_tokens=2) == [0, 0]
               for _ in range(40))


def test_the_prior_of_new_requests_is_kept_per_temperature_bucket() -> None:
    # Greedy requests' drafts accepted 9 times in 10, temperature-1.0 requests' 1 time in 20, on the CPU-like
    # line (35 ms + 7 ms per token): a new request of each starts from its own bucket's average, so the
    # sampled one does not draft on the greedy flood's optimism and the greedy one is not held back.
    greedy, sampled = temperature_bucket(0.0), temperature_bucket(1.0)
    assert greedy != sampled
    c, _ = controller(fixed=0.035, per_token=0.007, accept=0.0, max_k=4, requests=0)
    rng = random.Random(0)

    def requests(name: str, bucket: str, accept: float) -> None:
        for i in range(400):
            accepted = 0
            while accepted < 4 and rng.random() < accept:
                accepted += 1
            c.observe_verification(f"{name}{i % 8}", 4, accepted, bucket)

    requests("g", greedy, 0.9)
    # A bucket nothing has drafted in yet starts from the flat prior, not from the greedy requests'.
    assert c.acceptance.probabilities("first-sampled", sampled)[0] == pytest.approx(0.5)
    requests("s", sampled, 0.05)
    assert c.acceptance.method_average(0, greedy) > 0.85 and c.acceptance.method_average(0, sampled) < 0.1
    new_sampled, new_greedy = Candidate("new-t1", 4, bucket=sampled), Candidate("new-t0", 4, bucket=greedy)
    assert c.choose([new_sampled], base_tokens=1) == [0]
    assert c.choose([new_greedy], base_tokens=1)[0] >= 2
    assert (ks := c.choose([Candidate("t1", 4, bucket=sampled), Candidate("t0", 4, bucket=greedy)],
                           base_tokens=2))[0] == 0 and ks[1] >= 2


def test_verifications_reach_the_controller_and_the_stats_with_their_bucket() -> None:
    # SpecDecoding.observe: a greedy and a temperature-0.8 request verify drafts in one step.
    from engine.request import Request
    from engine.spec.backoff import DraftBackoff
    from engine.spec.decoding import SpecDecoding
    from engine.step import RunnerOutput, ScheduledRequest, SchedulerOutput

    spec = SpecDecoding.__new__(SpecDecoding)  # the observation path only: no proposer, no model
    spec.backoff, spec.adaptive = DraftBackoff(), AdaptiveController(4)
    reqs = {rid: Request(rid, [1, 2, 3], SamplingParams(temperature=t), 16, [0])
            for rid, t in (("g", 0.0), ("s", 0.8))}
    so = SchedulerOutput([ScheduledRequest(rid, [3, 7, 7, 7], 2, [], 4, [7, 7, 7], r.params, [1, 2, 3], [],
                                           [0]) for rid, r in reqs.items()])
    res = RunnerOutput(num_accepted_drafts=[3, 0], errors=[None, None], hidden=[None, None])
    st = spec.observe(so, res, reqs)
    counts = {b: (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)
              for b, c in st.by_temperature.items()}
    assert counts == {"0": (1, 3, 3), "(0.5,1]": (1, 3, 0)}
    acc = spec.adaptive.acceptance
    assert acc.method_average(0, "0") > 0.5 > acc.method_average(0, "(0.5,1]")
    assert acc.method_average(0, "(0,0.5]") == 0.5  # untouched


def test_respects_per_request_caps() -> None:
    c, _ = controller(fixed=0.040, per_token=0.0001, accept=1.0, max_k=6)
    cands = [Candidate("r0", 2), Candidate("r1", 0)]
    assert c.choose(cands, base_tokens=2) == [2, 0]


# -- "auto" through the real engine ------------------------------------------------------------------
AUTO = {
    "ngram": {"method": "ngram", "num_speculative_tokens": "auto", "prompt_lookup_min": 2,
              "prompt_lookup_max": 5},
    "draft_model": {"method": "draft_model", "model": "<target>", "num_speculative_tokens": "auto",
                    "adaptive": {"max_num_speculative_tokens": 3}},
}


def test_auto_config_parses_and_static_keys_still_validate() -> None:
    from engine.spec.config import SpeculativeConfigError, parse_speculative_config

    spec = parse_speculative_config({**AUTO["ngram"], "adaptive": {"max_num_speculative_tokens": 5}})
    assert spec.adaptive is not None and spec.num_speculative_tokens == 5
    assert parse_speculative_config(AUTO["ngram"]).num_speculative_tokens == 6  # the method's default cap
    assert parse_speculative_config({**AUTO["ngram"], "disable_by_batch_size": 4}).tokens_for_batch(5) == 0
    for bad, key in [({**AUTO["ngram"], "adaptive": {"bogus": 1}}, "adaptive.bogus"),
                     ({**AUTO["ngram"], "num_speculative_tokens": 3, "adaptive": {}}, "adaptive"),
                     ({**AUTO["ngram"], "num_speculative_tokens": "fast"}, "num_speculative_tokens"),
                     ({**AUTO["ngram"], "adaptive": {"acceptance_ema": 0}}, "acceptance_ema")]:
        with pytest.raises(SpeculativeConfigError, match=key):
            parse_speculative_config(bad)


@pytest.mark.parametrize("method", list(AUTO))
def test_auto_is_exact_at_batch_1_and_4(method: str) -> None:
    from tests.helpers import default_model, make_llm
    from tests.spec.test_spec import GREEDY, assert_pool_full, plain, prompts

    cfg = dict(AUTO[method])
    if cfg.get("model") == "<target>":
        cfg["model"] = default_model().path
    llm = make_llm(speculative_config=cfg)
    ps, ref = prompts()[-5:], plain()[-5:]  # chat and copy-heavy prompts
    drafted = 0
    for bs in (1, 4):
        for i in range(0, len(ps), bs):
            for o, r in zip(llm.generate(ps[i:i + bs], GREEDY), ref[i:i + bs], strict=True):
                assert o.token_ids == r
                drafted += o.spec_num_draft_tokens
    if method == "ngram":
        assert drafted > 0, "auto never drafted on copy-heavy prompts"
    est = llm.core.speculation.adaptive.estimates()
    assert est["step_1_token_seconds"] > 0 and est["step_per_token_at_8_seconds"] > 0
    assert est["verify_first_draft_seconds"] >= est["verify_further_draft_seconds"] > 0
    assert_pool_full(llm)


def test_lookup_drafts_are_made_before_the_choice() -> None:
    """ngram with auto: the engine looks drafts up first, so the controller chooses among the requests that
    have a match, never more tokens than the match gives, and a request without one is not counted as
    backed off (its re-probe clock only runs on steps where it could have drafted)."""
    import numpy as np

    from engine.spec.ngram import find_ngram_draft
    from tests.helpers import make_llm
    from tests.spec.test_spec import GREEDY, assert_pool_full, prompts

    llm = make_llm(speculative_config=AUTO["ngram"])
    core, est = llm.core, llm.core.speculation.adaptive.acceptance
    for i, p in enumerate(prompts()[-4:]):  # chat and copy-heavy prompts
        core.add_request(str(i), llm.encode(p), GREEDY)
    idle: dict[str, int] = {}
    no_match = drafted = 0
    while core.has_unfinished():
        core.step()
        for req in core.scheduler.running:
            if req.num_computed_tokens != req.num_tokens - 1:
                continue  # prefilling
            rid = req.request_id
            lookup = find_ngram_draft(np.asarray(req.all_token_ids), 2, 5, core.spec.num_speculative_tokens)
            assert req.spec_token_ids == lookup[: len(req.spec_token_ids)]
            now = est._state(rid).idle_steps
            if not lookup:
                no_match += 1
                # (it may fall to 0: the step verified a probe chosen the step before)
                assert now <= idle.get(rid, now), "a step without a match counted as backing off"
            drafted += bool(req.spec_token_ids)
            idle[rid] = now
    assert no_match > 0 and drafted > 0
    assert_pool_full(llm)


def test_auto_metrics_exposed(make_server) -> None:  # noqa: ANN001
    import httpx

    with make_server(speculative_config=AUTO["ngram"]) as srv:
        text = "red green blue red green blue red green blue red green blue"
        r = httpx.post(f"{srv.base_url}/completions", timeout=120, json={
            "model": srv.client.model_name, "prompt": f"Repeat: {text}\n{text}\n", "max_tokens": 24,
            "temperature": 0})
        assert r.status_code == 200
        scrape = httpx.get(srv.url + "/metrics").text
    assert "specserve:spec_decode_chosen_num_speculative_tokens_count" in scrape
    assert 'specserve:spec_decode_num_requests{drafting="true"' in scrape
    assert 'term="step_1_token"' in scrape and 'term="verify_further_draft"' in scrape
    count = next(float(line.split()[-1]) for line in scrape.splitlines()
                 if line.startswith("specserve:spec_decode_chosen_num_speculative_tokens_count"))
    assert count >= 10  # one observation per request-step that could draft
