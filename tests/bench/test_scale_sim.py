"""The replica capacity simulation (loadtests/scale_sim.py): its cost fit and its dynamics."""

from __future__ import annotations

from loadtests.scale_sim import Engine, StepCost, Workload, simulate

COST = StepCost(a=0.02, per_request=0.001, per_token=0.0002)
WL = Workload(system_tokens=200, user_tokens=60, reply_tokens=50, turns=4, think_s=5.0)


ENGINE = Engine()


def run(users: int, replicas: int, routing: str = "prefix", eng: Engine = ENGINE) -> dict:
    return simulate(users, replicas, routing, COST, WL, eng, duration_s=200, warmup_s=20)


def test_the_fit_recovers_a_linear_step_cost() -> None:
    records = [{"requests": r, "tokens": t, "step_s": COST(r, t)}
               for r in (1, 4, 16, 32) for t in (32, 100, 512)]
    fit = StepCost.fit(records)
    assert abs(fit.a - COST.a) < 1e-9 and abs(fit.per_request - COST.per_request) < 1e-9
    assert abs(fit.per_token - COST.per_token) < 1e-9


def test_replicas_add_throughput_where_one_engine_saturates() -> None:
    one, four = run(200, 1), run(200, 4)
    assert four["tokens_per_s"] > 2.5 * one["tokens_per_s"]
    assert four["ttft_p99_s"] < one["ttft_p99_s"]


def test_light_load_does_not_need_replicas() -> None:
    one, four = run(2, 1), run(2, 4)
    assert abs(four["tokens_per_s"] - one["tokens_per_s"]) < 0.25 * one["tokens_per_s"]


def test_sticky_routing_keeps_the_hit_rate_of_one_engine() -> None:
    single = run(40, 1)
    prefix, scattered = run(40, 4, "prefix"), run(40, 4, "power-of-two")
    assert single["hit_rate"] > 0.5
    assert prefix["hit_rate"] >= 0.95 * single["hit_rate"]
    assert scattered["hit_rate"] < 0.7 * prefix["hit_rate"]


def test_no_room_for_a_prefix_cache_means_no_hits() -> None:
    tight = Engine(kv_tokens=600, max_num_seqs=64, max_num_batched_tokens=512)
    assert run(20, 1, eng=tight)["hit_rate"] < 0.1
    assert run(20, 1)["hit_rate"] > 0.5
