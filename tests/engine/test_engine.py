"""End-to-end engine correctness on the real SmolLM2-135M model (float32, greedy)."""

from __future__ import annotations

import functools

import pytest

from engine.kv.cache import PagedKVCache
from engine.llm import LLM
from engine.models import adapter
from engine.sampling import SamplingParams
from tests.helpers import chat_prompts, default_model, make_llm, reference_greedy

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def assert_pool_full(llm: LLM) -> None:
    kv = llm.core.kv
    assert not llm.core.has_unfinished()
    assert kv.num_free_blocks == kv.pool.num_blocks, "KV blocks leaked"


@functools.cache
def _prompts() -> tuple[tuple[int, ...], ...]:
    llm = make_llm()
    ps = chat_prompts(llm)
    ps.append(list(range(1000, 1003)))  # a raw 3-token prompt, shorter than a block
    return tuple(tuple(p) for p in ps)


def prompts() -> list[list[int]]:
    return [list(p) for p in _prompts()]


@functools.cache
def _reference() -> tuple[tuple[int, ...], ...]:
    loaded = default_model()
    return tuple(tuple(reference_greedy(loaded, p, MAX_TOKENS)) for p in prompts())


def reference() -> list[list[int]]:
    return [list(r) for r in _reference()]


def test_prompts_cross_block_boundaries() -> None:
    lengths = sorted(len(p) for p in prompts())
    assert lengths[0] < 16 and lengths[-1] > 4 * 16, lengths
    assert len(set(len(p) // 16 for p in prompts())) >= 4


def test_greedy_batched_equals_mlx_lm_reference() -> None:
    llm = make_llm()
    outs = llm.generate(prompts(), GREEDY)
    for p, o, ref in zip(prompts(), outs, reference(), strict=True):
        assert o.token_ids == ref, f"prompt of {len(p)} tokens diverged"
        assert o.finish_reason in ("stop", "length")
    assert any(o.finish_reason == "length" for o in outs)
    assert_pool_full(llm)


def test_single_equals_batched() -> None:
    llm = make_llm()
    for p, ref in zip(prompts(), reference(), strict=True):
        (o,) = llm.generate([p], GREEDY)
        assert o.token_ids == ref
    assert_pool_full(llm)


def test_prefix_cache_hits_keep_outputs() -> None:
    llm = make_llm()
    first = llm.generate(prompts(), GREEDY)
    again = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in first] == reference()
    long_ones = [o for o, p in zip(again, prompts(), strict=True) if len(p) > 32]
    assert long_ones and all(o.num_cached_tokens >= 16 for o in long_ones)
    assert llm.core.kv.prefix_hits > 0
    assert_pool_full(llm)


def test_shared_prefix_in_one_batch() -> None:
    llm = make_llm()
    system = "You are a careful assistant. Answer briefly and precisely, in plain English. " * 3
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in ("Name a colour.", "Name an animal.", "Name a planet.")]
    ps = [llm.apply_chat_template(m) for m in msgs]
    # Warm the cache with the first, then submit all three together.
    llm.generate([ps[0]], GREEDY)
    outs = llm.generate(ps, GREEDY)
    assert all(o.num_cached_tokens >= 32 for o in outs)
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == reference_greedy(default_model(), p, MAX_TOKENS)
    assert_pool_full(llm)


def test_chunked_prefill_small_budget() -> None:
    llm = make_llm(max_num_batched_tokens=7)
    outs = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference()
    assert_pool_full(llm)


def test_preemption_with_tiny_block_budget() -> None:
    loaded = default_model()
    per_block = PagedKVCache.bytes_per_block(adapter.kv_layout(loaded.model).shapes, 16, loaded.dtype)
    llm = make_llm(max_model_len=256, kv_cache_memory=str(16 * per_block))
    assert llm.core.kv.pool.num_blocks == 16
    outs = llm.generate(prompts(), GREEDY)
    assert llm.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference()
    assert_pool_full(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    llm = make_llm()
    ps = prompts()[:4]
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate([ps[0]], seeded)[0].token_ids
    batched = llm.generate(ps, [seeded] + [SamplingParams(max_tokens=16, temperature=1.0)] * 3)[0].token_ids
    assert alone == batched
    other = llm.generate([ps[0]], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=99))
    # Different seeds diverge somewhere on a 16-token sample at temperature 0.9 (checked, not assumed:
    # if both ever matched the greedy path the test would say so).
    assert other[0].token_ids != alone or alone != reference()[0][:16]
    assert_pool_full(llm)


def test_temperature_zero_equals_greedy_with_filters_and_mixed_batch() -> None:
    llm = make_llm()
    ps = prompts()
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, top_k=5, seed=7) if i % 2 == 0
              else SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i) for i in range(len(ps))]
    outs = llm.generate(ps, params)
    for i, (o, ref) in enumerate(zip(outs, reference(), strict=True)):
        if i % 2 == 0:
            assert o.token_ids == ref
    assert_pool_full(llm)


def test_abort_returns_blocks() -> None:
    llm = make_llm()
    core = llm.core
    for i, p in enumerate(prompts()):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=100, temperature=0.0))
    for _ in range(3):
        core.step()
    assert core.kv.num_free_blocks < core.kv.pool.num_blocks
    outs = [core.abort_request(f"r{i}") for i in range(len(prompts()))]
    assert all(o is not None and o.finish_reason == "abort" for o in outs)
    assert core.abort_request("r0") is None
    assert_pool_full(llm)


def test_too_long_prompt_is_rejected_before_entering() -> None:
    llm = make_llm(max_model_len=64)
    with pytest.raises(ValueError, match="64"):
        llm.core.add_request("x", list(range(64)), GREEDY)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.core.add_request("y", [10**7], GREEDY)
    assert not llm.core.has_unfinished()
    # max_tokens is capped by the room left.
    long_params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    (o,) = llm.generate([list(range(1000, 1060))], long_params)
    assert len(o.token_ids) == 4 and o.finish_reason == "length"
    assert_pool_full(llm)


def test_stop_strings_and_stop_token_ids() -> None:
    llm = make_llm()
    p = prompts()[7]  # counting: "one, two, three, four, ..."
    ref_text = llm.generate([p], GREEDY)[0].text
    assert "," in ref_text
    stop = ref_text.split(",")[1]  # some word that appears in the output
    (o,) = llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=[stop]))
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert stop not in o.text and ref_text.startswith(o.text)
    tok = reference()[7][3]
    (o,) = llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[tok]))
    ref = reference()[7]
    assert o.token_ids == ref[: ref.index(tok) + 1] and o.stop_reason == tok
    assert_pool_full(llm)
