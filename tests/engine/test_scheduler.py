"""Token-budget scheduler over a real KVCacheManager, driven by hand-made runner outputs (no model,
no runner): budgets, chunked prefill, preemption, prefix hits, draft verification and stops."""

from __future__ import annotations

import random

import pytest

from engine.kv.block_manager import KVCacheManager
from engine.output_processor import OutputProcessor
from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.stats import IterationStats
from engine.step import RunnerOutput, ScheduledRequest, SchedulerOutput
from engine.structured import StructuredOutputManager

BS = 4
EOS = 2


def make_sched(num_blocks: int = 32, max_num_seqs: int = 4, budget: int = 64, max_model_len: int = 256,
               prefix_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len)


def make_req(rid: str, prompt: list[int], max_tokens: int = 64, **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt),
                   params=SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens,
                   eos_token_ids=[EOS])


def tokens(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def runner_output(out: SchedulerOutput, sampled: dict[str, list[int]] | None = None,
                  accept: dict[str, int] | None = None) -> RunnerOutput:
    """`sampled[id]` verbatim, else: nothing for a mid-prefill chunk, `accept[id]` drafts (default all)
    plus one token 1000 + its position."""
    rows = []
    for sr in out.scheduled:
        if sampled and sr.request_id in sampled:
            rows.append(list(sampled[sr.request_id]))
        elif sr.num_logits == 0:
            rows.append([])
        else:
            k = (accept or {}).get(sr.request_id, len(sr.spec_token_ids))
            pos = sr.start_pos + len(sr.token_ids) - len(sr.spec_token_ids) + k
            rows.append(sr.spec_token_ids[:k] + [1000 + pos])
    n = len(rows)
    return RunnerOutput(sampled_token_ids=rows, logprobs=[None] * n,
                        num_accepted_drafts=[max(0, len(r) - 1) for r in rows], errors=[None] * n,
                        hidden=[None] * n)


def make_proc(sched: Scheduler) -> OutputProcessor:
    return OutputProcessor(sched, tokenizer=None, structured=StructuredOutputManager(None),
                           release=lambda req: None, max_model_len=sched.max_model_len)


def new_stats() -> IterationStats:
    return IterationStats(timestamp=0.0, step_seconds=0.0, num_scheduled_requests=0, num_prompt_tokens=0,
                          num_generation_tokens=0, num_running=0, num_waiting=0, kv_cache_usage=0.0,
                          num_preempted=0, prefix_cache_queries=0, prefix_cache_hits=0)


def step(sched: Scheduler, sampled: dict[str, list[int]] | None = None, accept: dict[str, int] | None = None,
         proc: OutputProcessor | None = None) -> SchedulerOutput:
    """One engine step; with `proc`, the output processor finishes what stopped."""
    out = sched.schedule()
    res = runner_output(out, sampled, accept)
    updates = sched.update(out, res)
    if proc is not None:
        proc.process(updates, out, res, new_stats())
    return out


def by_id(out: SchedulerOutput) -> dict[str, ScheduledRequest]:
    return {sr.request_id: sr for sr in out.scheduled}


def assert_pool_whole(sched: Scheduler) -> None:
    kv = sched.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


# -- scheduling ------------------------------------------------------------------------------------


def test_max_num_seqs_and_fifo_admission() -> None:
    sched = make_sched(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_req(rid, tokens(5, base=ord(rid) * 10)))
    out = step(sched)
    assert [sr.request_id for sr in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert sched.requests["c"].status == RequestStatus.WAITING and not sched.kv.has("c")
    out = step(sched)  # still full: two decodes only
    assert [sr.request_id for sr in out.scheduled] == ["a", "b"]
    assert all(len(sr.token_ids) == 1 for sr in out.scheduled)
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = step(sched)
    assert [sr.request_id for sr in out.scheduled] == ["b", "c"]
    assert by_id(out)["c"].token_ids == tokens(5, base=ord("c") * 10)


def test_token_budget_respected_and_head_of_line_admission() -> None:
    sched = make_sched(budget=10)
    for rid in "abc":
        sched.add_request(make_req(rid, tokens(6, base=ord(rid) * 10)))
    out = sched.schedule()
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("a", 6), ("b", 4)]
    assert out.num_batched_tokens == 10
    assert [r.request_id for r in sched.waiting] == ["c"]
    sched.update(out, runner_output(out))
    out = sched.schedule()
    # a decodes, b finishes its prompt, c gets what is left.
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("a", 1), ("b", 2), ("c", 6)]
    assert out.num_batched_tokens == 9
    sched.update(out, runner_output(out))


def test_waiting_head_that_does_not_fit_blocks_later_requests() -> None:
    sched = make_sched(num_blocks=4)
    sched.add_request(make_req("a", tokens(8)))  # 2 blocks
    step(sched)
    sched.add_request(make_req("big", tokens(12, base=200)))  # 3 blocks: 1 is free once a grows
    sched.add_request(make_req("small", tokens(3, base=300)))  # 1 block would fit
    out = step(sched)
    assert [sr.request_id for sr in out.scheduled] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]
    assert not sched.kv.has("big") and not sched.kv.has("small")


def test_prefill_and_decodes_share_one_batch() -> None:
    sched = make_sched()
    sched.add_request(make_req("a", tokens(5)))
    step(sched)
    a = sched.requests["a"]
    assert a.num_computed_tokens == 5 and a.output_token_ids == [1005]
    sched.add_request(make_req("b", tokens(7, base=200)))
    out = sched.schedule()
    srs = by_id(out)
    assert srs["a"].token_ids == [1005] and srs["a"].start_pos == 5 and srs["a"].num_logits == 1
    assert srs["b"].token_ids == tokens(7, base=200) and srs["b"].start_pos == 0 and srs["b"].num_logits == 1
    assert out.num_batched_tokens == 8 and not out.decode_only
    sched.update(out, runner_output(out))
    assert a.output_token_ids == [1005, 1006] and sched.requests["b"].output_token_ids == [1007]


# -- chunked prefill -------------------------------------------------------------------------------


def test_chunked_prefill_chunks_continue_and_only_last_has_logits() -> None:
    sched = make_sched(budget=8)
    prompt = tokens(22)
    sched.add_request(make_req("a", prompt))
    req = sched.requests["a"]
    expect = [(0, 8, 0), (8, 8, 0), (16, 6, 1)]
    for start, n, logits in expect:
        out = sched.schedule()
        (sr,) = out.scheduled
        assert (sr.start_pos, len(sr.token_ids), sr.num_logits) == (start, n, logits)
        assert sr.token_ids == prompt[start:start + n]
        assert len(sched.kv.block_table("a")) == -(-(start + n) // BS)
        sched.update(out, runner_output(out))
        assert req.num_computed_tokens == start + n
        assert req.output_token_ids == ([] if logits == 0 else [1022])
    (sr,) = sched.schedule().scheduled
    assert (sr.start_pos, sr.token_ids, sr.num_logits) == (22, [1022], 1)


def test_chunk_takes_what_running_decodes_leave() -> None:
    sched = make_sched(budget=8)
    sched.add_request(make_req("a", tokens(3)))
    step(sched)
    sched.add_request(make_req("b", tokens(20, base=200)))
    out = sched.schedule()
    srs = by_id(out)
    assert len(srs["a"].token_ids) == 1
    assert (srs["b"].start_pos, len(srs["b"].token_ids), srs["b"].num_logits) == (0, 7, 0)
    sched.update(out, runner_output(out))
    out = sched.schedule()
    assert (by_id(out)["b"].start_pos, len(by_id(out)["b"].token_ids)) == (7, 7)


# -- preemption ------------------------------------------------------------------------------------


def test_newest_running_request_is_preempted_and_resumes() -> None:
    # Prefix caching off: the resumed request recomputes every token.
    sched = make_sched(num_blocks=6, max_num_seqs=3, prefix_caching=False)
    for rid in "abc":
        sched.add_request(make_req(rid, tokens(8, base=ord(rid) * 10)))
    step(sched)
    assert sched.kv.num_free_blocks == 0
    sched.add_request(make_req("d", tokens(2, base=500)))
    c = sched.requests["c"]
    c_blocks = list(sched.kv.block_table("c"))
    out = step(sched)  # a and b each need a third block
    assert out.preempted_ids == ["c"]
    assert [sr.request_id for sr in out.scheduled] == ["a", "b"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert not sched.kv.has("c") and sched.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    assert set(c_blocks) <= set(sched.kv.block_table("a") + sched.kv.block_table("b"))
    assert c.output_token_ids == [1008]
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    sr = by_id(out)["c"]
    assert sr.start_pos == 0 and sr.token_ids == tokens(8, base=ord("c") * 10) + [1008] and sr.num_logits == 1
    assert c.status == RequestStatus.RUNNING and len(sched.kv.block_table("c")) == 3
    sched.update(out, runner_output(out))
    assert c.num_computed_tokens == 9 and c.output_token_ids == [1008, 1009]


def test_preempting_step_admits_no_waiting_request() -> None:
    # A small budget: the victim's first chunk would fit the block a leaves free.
    sched = make_sched(num_blocks=4, budget=5, prefix_caching=False)
    sched.add_request(make_req("a", tokens(4)))
    sched.add_request(make_req("b", tokens(4, base=200)))
    for _ in range(10):
        out = sched.schedule()
        if out.preempted_ids:
            break
        sched.update(out, runner_output(out))
    assert out.preempted_ids == ["b"] and [sr.request_id for sr in out.scheduled] == ["a"]
    assert sched.requests["a"].num_computed_tokens == 8 and len(sched.kv.block_table("a")) == 3
    assert sched.kv.num_free_blocks == 1 and [r.request_id for r in sched.waiting] == ["b"]
    sched.update(out, runner_output(out))
    out = sched.schedule()  # the next step takes b back, as a 4-token chunk
    assert [(sr.request_id, sr.start_pos, len(sr.token_ids)) for sr in out.scheduled] == [("a", 9, 1),
                                                                                         ("b", 0, 4)]


# -- prefix cache ----------------------------------------------------------------------------------


def test_prefix_hit_reuses_full_blocks() -> None:
    sched = make_sched()
    prompt = tokens(10)
    sched.add_request(make_req("a", prompt))
    step(sched)
    sched.add_request(make_req("b", prompt[:8] + [7, 7, 7]))
    out = sched.schedule()
    b = sched.requests["b"]
    assert b.num_cached_prompt_tokens == 8 and b.num_computed_tokens == 8
    sr = by_id(out)["b"]
    assert sr.start_pos == 8 and sr.token_ids == [7, 7, 7]
    a_table, b_table = sched.kv.block_table("a"), sched.kv.block_table("b")
    assert b_table[:2] == a_table[:2] and b_table[2] not in a_table
    assert [sched.kv.pool.blocks[i].ref_cnt for i in b_table] == [2, 2, 1]
    sched.update(out, runner_output(out))


def test_prefix_hit_after_owner_finished_and_whole_prompt_keeps_last_token() -> None:
    sched = make_sched()
    prompt = tokens(8)
    sched.add_request(make_req("a", prompt))
    step(sched)
    a_blocks = list(sched.kv.block_table("a"))
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert_pool_whole(sched)
    sched.add_request(make_req("b", prompt))
    (sr,) = sched.schedule().scheduled
    # Only the first block hits: the last prompt token is always recomputed.
    assert sched.requests["b"].num_cached_prompt_tokens == 4
    assert sr.start_pos == 4 and sr.token_ids == prompt[4:]
    assert sched.kv.block_table("b")[0] == a_blocks[0]


def test_different_cache_salts_never_share_blocks() -> None:
    sched = make_sched()
    prompt = tokens(9)
    for rid, salt in [("plain", None), ("s1", "one"), ("s2", "two")]:
        sched.add_request(make_req(rid, prompt, cache_salt=salt))
        step(sched)
        assert sched.requests[rid].num_cached_prompt_tokens == 0
    tables = [set(sched.kv.block_table(rid)) for rid in ("plain", "s1", "s2")]
    assert not (tables[0] & tables[1]) and not (tables[0] & tables[2]) and not (tables[1] & tables[2])
    sched.add_request(make_req("s1-again", prompt, cache_salt="one"))
    step(sched)
    assert sched.requests["s1-again"].num_cached_prompt_tokens == 8
    assert sched.kv.block_table("s1-again")[:2] == sched.kv.block_table("s1")[:2]


def test_rejected_drafts_never_enter_the_prefix_cache() -> None:
    sched = make_sched()
    prompt = tokens(6)
    sched.add_request(make_req("a", prompt))
    step(sched)
    a = sched.requests["a"]
    a.spec_token_ids = [51, 52, 53]  # positions 7..9: block 1 ends at position 7
    out = step(sched, accept={"a": 0})
    assert len(out.scheduled[0].token_ids) == 4
    assert a.num_computed_tokens == 7 and a.all_token_ids == prompt + [1006, 1007]
    table = sched.kv.block_table("a")
    assert sched.kv.pool.blocks[table[0]].block_hash is not None
    assert sched.kv.pool.blocks[table[1]].block_hash is None
    sched.add_request(make_req("with-draft", prompt + [1006, 51, 9]))
    step(sched)  # a also computes position 7 (its real token): block 1 is confirmed now
    assert sched.requests["with-draft"].num_cached_prompt_tokens == 4
    assert sched.kv.pool.blocks[table[1]].block_hash is not None
    sched.add_request(make_req("real", prompt + [1006, 1007, 9]))
    step(sched)
    assert sched.requests["real"].num_cached_prompt_tokens == 8
    assert sched.kv.block_table("real")[:2] == table[:2]


# -- speculative slots -----------------------------------------------------------------------------


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_verification_rolls_back_rejected_slots(accepted: int) -> None:
    sched = make_sched()
    sched.add_request(make_req("a", tokens(6)))
    step(sched)
    a = sched.requests["a"]
    a.spec_token_ids = [51, 52, 53]
    out = sched.schedule()
    (sr,) = out.scheduled
    assert sr.token_ids == [1006, 51, 52, 53] and sr.spec_token_ids == [51, 52, 53]
    assert sr.start_pos == 6 and sr.num_logits == 4 and out.decode_only
    assert len(sched.kv.block_table("a")) == 3  # slots for 10 tokens
    sched.update(out, runner_output(out, accept={"a": accepted}))
    assert a.spec_token_ids == []
    assert a.output_token_ids == [1006] + [51, 52, 53][:accepted] + [1007 + accepted]
    assert a.num_computed_tokens == 7 + accepted
    (sr,) = sched.schedule().scheduled
    # The first rejected draft's slot (or the next one) is where computing resumes.
    assert sr.start_pos == 7 + accepted and sr.token_ids == [1007 + accepted] and sr.num_logits == 1


def test_drafts_that_do_not_fit_are_dropped_whole() -> None:
    sched = make_sched(budget=5)
    sched.add_request(make_req("a", tokens(2)))
    sched.add_request(make_req("b", tokens(2, base=200)))
    step(sched)
    a, b = sched.requests["a"], sched.requests["b"]
    a.spec_token_ids, b.spec_token_ids = [51, 52], [61, 62]
    out = sched.schedule()
    srs = by_id(out)
    assert srs["a"].token_ids == [1002, 51, 52] and srs["a"].num_logits == 3
    # Two budget slots remain for b: it verifies no draft rather than one.
    assert srs["b"].token_ids == [1002] and srs["b"].spec_token_ids == [] and srs["b"].num_logits == 1
    assert b.spec_token_ids == [] and out.num_batched_tokens == 4
    sched.update(out, runner_output(out))
    assert b.num_computed_tokens == 3 and b.output_token_ids == [1002, 1003]


# -- stops -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "sampled", "status", "stop_reason"), [
    ({}, [EOS], RequestStatus.FINISHED_STOPPED, None),
    ({"stop_token_ids": [9]}, [9], RequestStatus.FINISHED_STOPPED, 9),
    ({"max_tokens": 1}, [5], RequestStatus.FINISHED_LENGTH, None),
])
def test_stop_finishes_and_frees(params: dict, sampled: list[int], status: RequestStatus,
                                 stop_reason: int | None) -> None:
    sched = make_sched()
    proc = make_proc(sched)
    sched.add_request(make_req("keep", tokens(5, base=300)))
    sched.add_request(make_req("a", tokens(5), **params))
    a = sched.requests["a"]
    step(sched, sampled={"a": sampled}, proc=proc)
    assert a.status == status and a.stop_reason == stop_reason and a.output_token_ids == sampled
    assert not sched.kv.has("a") and "a" not in sched.requests
    assert [r.request_id for r in sched.running] == ["keep"]
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks - len(sched.kv.block_table("keep"))
    sched.finish_request("keep", RequestStatus.FINISHED_ABORTED)
    assert_pool_whole(sched)


def test_accepted_drafts_past_a_stop_are_dropped() -> None:
    sched = make_sched()
    proc = make_proc(sched)
    sched.add_request(make_req("a", tokens(5), stop_token_ids=[9]))
    req = sched.requests["a"]
    step(sched, proc=proc)
    req.spec_token_ids = [51, 9, 53]
    step(sched, sampled={"a": [51, 9, 53, 60]}, proc=proc)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 9
    assert req.output_token_ids == [1005, 51, 9]
    assert_pool_whole(sched)


def test_ignore_eos_and_min_tokens() -> None:
    sched = make_sched()
    proc = make_proc(sched)
    sched.add_request(make_req("ign", tokens(3), ignore_eos=True, max_tokens=3))
    sched.add_request(make_req("min", tokens(3, base=200), stop_token_ids=[9], min_tokens=3))
    ign, mn = sched.requests["ign"], sched.requests["min"]
    step(sched, sampled={"ign": [EOS], "min": [EOS]}, proc=proc)
    step(sched, sampled={"ign": [EOS], "min": [9]}, proc=proc)
    assert ign.status == mn.status == RequestStatus.RUNNING
    assert mn.output_token_ids == [EOS, 9]
    step(sched, sampled={"ign": [EOS], "min": [EOS]}, proc=proc)
    assert ign.status == RequestStatus.FINISHED_LENGTH and ign.output_token_ids == [EOS] * 3
    assert mn.status == RequestStatus.FINISHED_STOPPED and mn.num_output_tokens == 3
    assert_pool_whole(sched)


def test_max_model_len_finishes_with_length() -> None:
    sched = make_sched(max_model_len=8)
    proc = make_proc(sched)
    sched.add_request(make_req("a", tokens(6)))
    req = sched.requests["a"]
    step(sched, proc=proc)
    assert req.status == RequestStatus.RUNNING
    step(sched, proc=proc)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 8
    assert_pool_whole(sched)


def test_finish_request_frees_running_and_waiting() -> None:
    sched = make_sched(max_num_seqs=1)
    sched.add_request(make_req("a", tokens(9)))
    sched.add_request(make_req("b", tokens(9, base=200)))
    step(sched)
    assert sched.kv.has("a") and not sched.kv.has("b")
    b = sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert b is not None and b.status == RequestStatus.FINISHED_ABORTED and not sched.waiting
    a = sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert a is not None and a.status == RequestStatus.FINISHED_ABORTED and not sched.running
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    assert sched.num_unfinished == 0 and sched.schedule().is_empty
    assert_pool_whole(sched)


def test_abort_while_a_step_runs_and_runner_error() -> None:
    sched = make_sched()
    proc = make_proc(sched)
    sched.add_request(make_req("a", tokens(5)))
    sched.add_request(make_req("b", tokens(5, base=200)))
    sched.add_request(make_req("c", tokens(5, base=300)))
    b = sched.requests["b"]
    out = sched.schedule()
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    res = runner_output(out)
    res.sampled_token_ids[1], res.errors[1] = [], "boom"
    updates = sched.update(out, res)
    assert [(r.request_id, toks, err) for r, toks, err in updates] == [("b", [], "boom"), ("c", [1005], None)]
    assert b.num_computed_tokens == 0
    proc.process(updates, out, res, new_stats())
    assert b.status == RequestStatus.FINISHED_ERROR and b.error == "boom"
    assert list(sched.requests) == ["c"] and sched.kv.num_free_blocks == sched.kv.pool.num_blocks - 2
    sched.finish_request("c", RequestStatus.FINISHED_ABORTED)
    assert_pool_whole(sched)


# -- everything at once ----------------------------------------------------------------------------


def check_and_write_kv(sched: Scheduler, slots: dict[int, list[int | None]], out: SchedulerOutput) -> None:
    """Slots before start_pos must hold the request's own tokens; then this step's tokens are written."""
    for sr in out.scheduled:
        req = sched.requests[sr.request_id]
        table = sr.block_table
        assert len(table) * BS >= sr.start_pos + len(sr.token_ids)
        seen = [slots.setdefault(table[p // BS], [None] * BS)[p % BS] for p in range(sr.start_pos)]
        assert seen == req.all_token_ids[:sr.start_pos], sr.request_id
        for j, tok in enumerate(sr.token_ids):
            p = sr.start_pos + j
            slots.setdefault(table[p // BS], [None] * BS)[p % BS] = tok


def test_random_workload_keeps_invariants_and_returns_every_block() -> None:
    rng = random.Random(0)
    max_seqs, budget, max_len = 4, 12, 40
    sched = make_sched(num_blocks=12, max_num_seqs=max_seqs, budget=budget, max_model_len=max_len)
    proc = make_proc(sched)
    shared = tokens(8, base=500)
    reqs = [make_req(f"r{i}", shared[:rng.choice([0, 4, 8])] + tokens(rng.randint(1, 16), base=100 * i),
                     max_tokens=rng.randint(1, 12), cache_salt=rng.choice([None, None, "s"]))
            for i in range(12)]
    for r in reqs:
        sched.add_request(r)
    slots: dict[int, list[int | None]] = {}
    preempted = verified = 0
    for _ in range(400):
        if not sched.requests:
            break
        for r in sched.running:
            k = rng.randint(0, 3)
            decoding = r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1
            if decoding and r.num_tokens + k <= max_len:
                r.spec_token_ids = [rng.choice([EOS, 50, 51]) for _ in range(k)]
        out = sched.schedule()
        preempted += len(out.preempted_ids)
        verified += sum(1 for sr in out.scheduled if sr.spec_token_ids)
        assert len(out.scheduled) <= max_seqs and len(sched.running) <= max_seqs
        assert out.num_batched_tokens == sum(len(sr.token_ids) for sr in out.scheduled) <= budget
        for sr in out.scheduled:
            req = sched.requests[sr.request_id]
            assert sr.start_pos == req.num_computed_tokens
            assert sr.token_ids == (req.all_token_ids + req.spec_token_ids)[sr.start_pos:][:len(sr.token_ids)]
            assert sr.num_logits in (0, 1 + len(sr.spec_token_ids))
        check_and_write_kv(sched, slots, out)
        held = [b for r in sched.running for b in sched.kv.block_table(r.request_id)]
        assert all(sched.kv.pool.blocks[b].ref_cnt == held.count(b) for b in set(held))
        assert sched.kv.num_free_blocks + len(set(held)) == sched.kv.pool.num_blocks
        accept = {sr.request_id: rng.randint(0, len(sr.spec_token_ids)) for sr in out.scheduled}
        res = runner_output(out, accept=accept)
        proc.process(sched.update(out, res), out, res, new_stats())
    assert not sched.requests and not sched.running and not sched.waiting
    assert preempted > 0 and verified > 0 and any(r.num_cached_prompt_tokens for r in reqs)
    assert all(r.status.finished and 1 <= r.num_output_tokens <= r.max_tokens for r in reqs)
    assert_pool_whole(sched)
