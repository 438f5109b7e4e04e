"""Speculative decoding: exact greedy equality inside continuous batching, config validation,
verification table, proposers, and the acceptance counters."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import numpy as np
import pytest

from engine.kv.cache import PagedKVCache
from engine.models import adapter
from engine.sampling import SamplingParams
from engine.spec.config import SpeculativeConfigError, parse_speculative_config
from engine.spec.ngram import find_ngram_draft
from engine.spec.proposer import DraftRequest
from engine.spec.suffix import SuffixProposer
from engine.spec.verify import accept_matching, accept_matching_constrained
from tests.helpers import CHATS, default_model, make_llm

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)

COPY_TEXT = ("The quick brown fox jumps over the lazy dog near the river bank. A small bird sings on the "
             "old oak tree while the farmer walks to the market with a basket of red apples.")


@functools.cache
def _prompts() -> tuple[tuple[int, ...], ...]:
    llm = make_llm()
    texts = [*CHATS, f"Repeat this text exactly, word for word: {COPY_TEXT}",
             f"Rewrite this text with 'fox' replaced by 'cat': {COPY_TEXT}"]
    return tuple(tuple(llm.apply_chat_template([{"role": "user", "content": t}])) for t in texts)


def prompts() -> list[list[int]]:
    return [list(p) for p in _prompts()]


@functools.cache
def _plain() -> tuple[tuple[int, ...], ...]:
    outs = make_llm().generate(prompts(), GREEDY)
    return tuple(tuple(o.token_ids) for o in outs)


def plain() -> list[list[int]]:
    return [list(t) for t in _plain()]


METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    # greedy drafts: seeded sampled requests below must equal plain decoding (the coupled rule)
    "draft_model": {"method": "draft_model", "model": "<target>", "num_speculative_tokens": 3,
                    "draft_sample_method": "greedy"},
    # the shipped head: its KV at the target's block ids, through prefix hits and preemption
    "eagle3": {"method": "eagle3", "model": str(Path(__file__).resolve().parents[2] / "configs" / "assistants"
                                               / "smollm2-135m-eagle3"), "num_speculative_tokens": 3},
}


def spec_llm(method: str, speculative_config: dict | None = None, **kwargs):
    cfg = dict(METHODS[method]) | (speculative_config or {})
    if cfg.get("model") == "<target>":
        cfg["model"] = default_model().path  # the target as its own draft
    return make_llm(speculative_config=cfg, **kwargs)


def assert_pool_full(llm) -> None:
    assert not llm.core.has_unfinished()
    assert llm.core.kv.num_free_blocks == llm.core.kv.pool.num_blocks
    spec = llm.core.speculation
    draft_kv = getattr(spec.proposer, "kv", None) if spec is not None else None
    if draft_kv is not None:
        assert draft_kv.num_free_blocks == draft_kv.pool.num_blocks, "draft KV blocks leaked"


# -- pure pieces ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("drafts", "target", "expected"), [
    ([], [5], [5]),  # no drafts: plain decode
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted + bonus token
    ([1, 2, 3], [9, 2, 3, 4], [9]),  # first rejected: the target's token
    ([1, 2, 3], [1, 7, 3, 4], [1, 7]),  # early mismatch
    ([1, 2, 3], [1, 2, 8, 4], [1, 2, 8]),  # late mismatch
    ([4, 4], [4, 4, 4], [4, 4, 4]),  # repeats
])
def test_accept_matching_table(drafts: list[int], target: list[int], expected: list[int]) -> None:
    assert accept_matching(drafts, target) == expected


def test_accept_matching_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        accept_matching([1, 2], [1, 2])
    with pytest.raises(ValueError):
        accept_matching_constrained([1, 2], [1, 2], lambda i, t: True, lambda i: 0)


def test_constrained_verification_without_masks_equals_verification_over_masked_logits() -> None:
    """Random logits, allowed sets (drafts the grammar forbids included) and ties: masking only where the
    unmasked argmax is not allowed gives accept_matching's tokens over the masked rows, and no position past
    the first rejected draft is asked about."""
    rng = random.Random(7)

    def argmax(row: list[float], keep: set[int] | None = None) -> int:  # ties to the lowest id
        return max((t for t in range(len(row)) if keep is None or t in keep), key=lambda t: (row[t], -t))

    for _ in range(3000):
        vocab, k = rng.randint(2, 6), rng.randint(0, 5)
        logits = [[float(rng.randint(0, 3)) for _ in range(vocab)] for _ in range(k + 1)]  # many ties
        allowed = [set(rng.sample(range(vocab), rng.randint(1, vocab))) for _ in range(k + 1)]
        drafts = [rng.randrange(vocab) for _ in range(k)]
        want = accept_matching(drafts, [argmax(r, a) for r, a in zip(logits, allowed, strict=True)])
        asked: list[int] = []

        def allows(i: int, t: int, allowed: list[set[int]] = allowed, asked: list[int] = asked) -> bool:
            asked.append(i)
            return t in allowed[i]

        got = accept_matching_constrained(drafts, [argmax(r) for r in logits], allows,
                                        lambda i, lg=logits, al=allowed: argmax(lg[i], al[i]))
        assert got == want
        assert asked == list(range(len(got)))


@pytest.mark.parametrize(("tokens", "lo", "hi", "k", "expected"), [
    ([1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 7, 8, 3, 4], 2, 4, 3, [7, 8, 3]),  # most recent of equal length
    # equally long matches (capped at 2): the one whose earlier tokens (11) also agree wins over recency
    ([10, 11, 3, 4, 20, 12, 13, 3, 4, 21, 10, 11, 3, 4], 2, 2, 1, [20]),
    ([12, 11, 3, 4, 20, 12, 11, 3, 4, 21, 10, 11, 3, 4], 2, 2, 1, [21]),  # context as long: most recent
    ([5, 1, 2, 3, 4, 6, 0, 1, 2, 3, 4], 1, 4, 2, [6, 0]),  # longest match wins
    ([1, 2, 3, 1, 2], 3, 3, 4, []),  # suffix shorter than min never matches
    ([7, 8, 7, 8, 7, 8], 2, 2, 5, [7, 8]),  # proposal truncated by the end of the sequence
    ([1, 2], 1, 2, 3, []),
])
def test_ngram_table(tokens: list[int], lo: int, hi: int, k: int, expected: list[int]) -> None:
    assert find_ngram_draft(np.array(tokens), lo, hi, k) == expected


def _ngram_by_definition(tokens: list[int], lo: int, hi: int, k: int, cap: int = 64) -> list[int]:
    """The rule spelt out with plain loops: the longest suffix (lo..hi tokens) that occurred earlier with
    a follower; among its occurrences the one whose earlier tokens agree with the context's for the most
    positions (up to `cap`), then the most recent; the k tokens after it."""
    n = len(tokens)
    for length in range(min(hi, n - 1), lo - 1, -1):
        suffix = tokens[n - length :]
        starts = [s for s in range(n - length) if tokens[s : s + length] == suffix]
        if not starts:
            continue

        def agreement(s: int, length: int = length) -> int:
            j = 0
            while j < min(cap, n - length) and s - j > 0 and tokens[s - j - 1] == tokens[n - length - j - 1]:
                j += 1
            return j

        best = max(agreement(s) for s in starts)
        s = [s for s in starts if agreement(s) == best][-1]
        return tokens[s + length : s + length + k]
    return []


def test_ngram_lookup_follows_its_definition() -> None:
    """Random contexts over tiny vocabularies (many equally long matches, so the tie rules decide)."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.choice([2, 3, 5, 40])), int(rng.integers(1, 90))).tolist()
        lo = int(rng.integers(1, 4))
        hi, k = int(rng.integers(lo, 7)), int(rng.integers(1, 6))
        assert find_ngram_draft(np.array(tokens), lo, hi, k) == _ngram_by_definition(tokens, lo, hi, k), \
            (tokens, lo, hi, k)


BAD_CONFIGS = [
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "bogus": 1}', "bogus"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 6, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "tensor_parallel_size": 2}', "tensor_parallel_size"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "temperature": 0.5}', "temperature"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "top_p": 0.5}', "top_p"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "model"),
    ('{"method": "mtp"}', "model"),
    ('{"method": "magic", "num_speculative_tokens": 3}', "method"),
    ('{"num_speculative_tokens": 3}', "method"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}',
     "draft_tensor_parallel_size"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "suffix_decoding_min_token_prob"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "draft_kv_cache_fraction": 1}',
     "draft_kv_cache_fraction"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "draft_kv_cache_fraction": 0.2}',
     "draft_kv_cache_fraction: unknown key"),
    ('{"method": "mtp", "model": "x", "draft_min_token_prob": 1}', "draft_min_token_prob"),
    ('{"method": "mtp", "model": "x", "draft_min_token_prob": [0.3, 1]}', "draft_min_token_prob"),
    ('{"method": "mtp", "model": "x", "draft_min_token_prob": []}', "draft_min_token_prob"),
    ('{"method": "mtp", "model": "x", "draft_min_token_prob": "high"}', "draft_min_token_prob"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "draft_min_token_prob": 0.3}',
     "draft_min_token_prob: unknown key"),
    ('not json', "JSON"),
]


@pytest.mark.parametrize(("text", "key"), BAD_CONFIGS)
def test_bad_configs_fail_naming_the_key(text: str, key: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=key):
        parse_speculative_config(text)


def test_mtp_cut_offs_one_or_per_position() -> None:
    base = {"method": "mtp", "model": "x"}
    assert parse_speculative_config(base).draft_min_token_prob == 0.0
    assert parse_speculative_config({**base, "draft_min_token_prob": 0.3}).draft_min_token_prob == 0.3
    per = parse_speculative_config({**base, "draft_min_token_prob": [0.35, 0.15]})
    assert per.draft_min_token_prob == [0.35, 0.15]


def test_config_defaults_like_vllm() -> None:
    c = parse_speculative_config('{"model": "ngram", "num_speculative_tokens": 4}')
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 5)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = parse_speculative_config({"model": "some/draft", "num_speculative_tokens": 2})
    assert c.method == "draft_model"
    c = parse_speculative_config({"method": "suffix"})
    assert c.num_speculative_tokens == c.suffix_decoding_max_tree_depth == 24
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 4,
                                  "num_speculative_tokens_per_batch_size": [[1, 4], [2, 2]]})
    assert [c.tokens_for_batch(b) for b in (1, 2, 3, 5)] == [4, 2, 0, 0]


def test_draft_with_other_vocabulary_fails_at_startup(tmp_path) -> None:
    from tests.engine.test_models import TINY, make_tiny_folder

    TINY["llama_small_vocab"] = dict(TINY["llama"], vocab_size=1000)
    try:
        folder = make_tiny_folder("llama_small_vocab", tmp_path)
    finally:
        del TINY["llama_small_vocab"]
    with pytest.raises(ValueError, match="vocabulary size 1000"):
        make_llm(speculative_config={"method": "draft_model", "model": str(folder),
                                     "num_speculative_tokens": 2})


def test_sliding_window_draft_fails_at_startup(tmp_path) -> None:
    from tests.engine.test_models import make_tiny_folder

    folder = make_tiny_folder("gemma3_text", tmp_path)
    with pytest.raises(ValueError, match="sliding-window"):
        make_llm(speculative_config={"method": "draft_model", "model": str(folder),
                                     "num_speculative_tokens": 2})


# -- exact greedy equality in the batched engine ---------------------------------------------------
@pytest.mark.parametrize("method", list(METHODS))
def test_spec_equals_plain_at_batch_1_4_8(method: str) -> None:
    llm = spec_llm(method)
    ps, ref = prompts(), plain()
    assert max(len(p) for p in ps) > 4 * 16  # prompts cross several block boundaries
    accepted = 0
    for bs in (1, 4, 8):
        for i in range(0, len(ps), bs):
            outs = llm.generate(ps[i:i + bs], GREEDY)
            for o, r in zip(outs, ref[i:i + bs], strict=True):
                assert o.token_ids == r
                accepted += o.spec_num_accepted_tokens
    assert accepted > 0, "no draft was ever accepted: speculation did not run"
    assert_pool_full(llm)


@pytest.mark.parametrize("method", list(METHODS))
def test_spec_mixed_with_sampled_requests_prefix_hits_and_preemption(method: str) -> None:
    loaded = default_model()
    per_block = PagedKVCache.bytes_per_block(adapter.kv_layout(loaded.model).shapes, 16, loaded.dtype)
    per_block *= 2 if method == "draft_model" else 1
    llm = spec_llm(method, max_model_len=256, kv_cache_memory=str(20 * per_block))
    ps = prompts()
    params = [GREEDY if i % 3 else SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9,
                                                  presence_penalty=0.5, seed=i)
              for i in range(len(ps))]
    ref = [o.token_ids for o in make_llm().generate(ps, params)]  # plain decoding, same seeds
    drafted = 0
    for _ in range(2):  # the second round hits the prefix cache
        outs = llm.generate(ps, params)
        for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
            assert o.token_ids == r, i  # seeded sampled requests too: the coupled check is exact
            drafted += o.spec_num_draft_tokens if i % 3 == 0 else 0
    assert drafted > 0, "sampled requests never drafted"
    assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.kv.prefix_hits > 0
    assert_pool_full(llm)


def test_disable_by_batch_size_turns_drafting_off() -> None:
    llm = make_llm(speculative_config={**METHODS["ngram"], "disable_by_batch_size": 2})
    copy_prompt, copy_ref = prompts()[-2], plain()[-2]
    # Three identical requests run (and finish) together: above the limit for their whole life.
    outs = llm.generate([copy_prompt] * 3, GREEDY)
    assert all(o.token_ids == copy_ref and o.spec_num_draft_tokens == 0 for o in outs)
    (alone,) = llm.generate([copy_prompt], GREEDY)
    assert alone.token_ids == copy_ref and alone.spec_num_accepted_tokens > 0
    assert_pool_full(llm)


def test_acceptance_counters_are_consistent() -> None:
    llm = spec_llm("ngram")
    core = llm.core
    ps = prompts()[-4:]
    for i, p in enumerate(ps):
        core.add_request(f"r{i}", p, GREEDY)
    steps_with_drafts = 0
    total = None
    while core.has_unfinished():
        so_preview = [r for r in core.scheduler.running if r.spec_token_ids]
        steps_with_drafts += len(so_preview)
        outs, stats = core.step()
        if stats is not None and stats.spec is not None:
            s = stats.spec
            assert s.num_accepted_tokens <= s.num_draft_tokens
            assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:], strict=False))
            assert sum(s.accepted_per_pos) == s.num_accepted_tokens
            if total is None:
                total = s
            else:
                total.num_drafts += s.num_drafts
                total.num_draft_tokens += s.num_draft_tokens
                total.num_accepted_tokens += s.num_accepted_tokens
    assert total is not None and total.num_drafts == steps_with_drafts > 0
    assert 0 < total.num_accepted_tokens <= total.num_draft_tokens
    assert_pool_full(llm)


# -- the draft model's share of the KV memory --------------------------------------------------------
def _target_block_bytes() -> int:
    loaded = default_model()
    return PagedKVCache.bytes_per_block(adapter.kv_layout(loaded.model).shapes, 16, loaded.dtype)


def test_draft_kv_split_static_auto_and_explicit() -> None:
    per_block = _target_block_bytes()  # the self-draft's blocks cost the same
    mem = str(400 * per_block)
    static = spec_llm("draft_model", max_model_len=256, kv_cache_memory=mem).core
    # a draft block beside each
    assert static.kv.pool.num_blocks == static.speculation.proposer.kv.pool.num_blocks == 200
    auto = spec_llm("draft_model", max_model_len=256, kv_cache_memory=mem,
                    speculative_config={"num_speculative_tokens": "auto"}).core
    # A quarter of the self-draft's half share: 50 draft blocks, the rest the target's.
    assert (auto.kv.pool.num_blocks, auto.speculation.proposer.kv.pool.num_blocks) == (350, 50)
    long_ctx = spec_llm("draft_model", max_model_len=1024, kv_cache_memory=mem,
                    speculative_config={"num_speculative_tokens": "auto"}).core
    assert long_ctx.speculation.proposer.kv.pool.num_blocks == 64  # raised to one request of max_model_len
    explicit = spec_llm("draft_model", max_model_len=256, kv_cache_memory=mem,
                        speculative_config={"draft_kv_cache_fraction": 0.1}).core
    assert (explicit.kv.pool.num_blocks, explicit.speculation.proposer.kv.pool.num_blocks) == (360, 40)
    with pytest.raises(ValueError, match="draft_kv_cache_fraction=0.01 gives the draft 4 KV blocks"):
        spec_llm("draft_model", max_model_len=256, kv_cache_memory=mem,
                 speculative_config={"draft_kv_cache_fraction": 0.01})


def test_small_draft_pool_takes_blocks_back_and_stays_exact() -> None:
    # 20 draft blocks (320 tokens) for 10 requests of ~80 tokens each: drafting for some takes the
    # blocks of others, which catch up later; output stays exactly the plain greedy output. Staggered
    # lengths: a request within a token of its end drafts no more but still holds draft blocks, which
    # the others then take back (with every request drafting each step there is no one to take from).
    params = [SamplingParams(max_tokens=MAX_TOKENS - 2 * i, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts()))]
    want = [o.token_ids for o in make_llm().generate(prompts(), params)]
    llm = spec_llm("draft_model", max_model_len=256, kv_cache_memory=str(200 * _target_block_bytes()),
                   speculative_config={"draft_kv_cache_fraction": 0.1})
    proposer = llm.core.speculation.proposer
    assert proposer.kv.pool.num_blocks == 20
    outs = llm.generate(prompts(), params)
    assert [o.token_ids for o in outs] == want
    assert proposer.num_evictions > 0
    # Every request that ran long enough got drafts (none starved while others held the pool).
    assert all(o.spec_num_accepted_tokens > 0 for o in outs if len(o.token_ids) >= 20)
    assert_pool_full(llm)


# -- exactness under load ------------------------------------------------------------------------------
def test_verification_beside_a_long_prefill_chunk_equals_plain() -> None:
    """One step over 256 rows (the default budget is 512): a request verifying drafts beside another's
    long prefill chunk. Both outputs are the plain greedy ones (tests/kernels/test_small_gemm.py checks the
    logits of such a step bitwise)."""
    llm = spec_llm("ngram")
    core = llm.core
    assert core.scheduler.max_num_batched_tokens == 512
    copy_prompt, copy_ref = prompts()[-2], plain()[-2]
    long_prompt = llm.apply_chat_template([{"role": "user", "content": " ".join(CHATS * 3)}])
    assert 300 < len(long_prompt) < 500
    (long_ref,) = make_llm().generate([long_prompt], GREEDY)
    tokens: dict[str, list[int]] = {"copy": [], "long": []}

    def step() -> tuple[int, int]:
        verifying = sum(1 for r in core.scheduler.running if r.spec_token_ids)
        outs, stats = core.step()
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
        return verifying, stats.num_batched_tokens if stats is not None else 0

    core.add_request("copy", copy_prompt, GREEDY)
    while not core.scheduler.requests["copy"].spec_token_ids:
        step()
    core.add_request("long", long_prompt, GREEDY)
    verifying, rows = step()  # the long prompt's whole prefill beside the copy's drafts
    assert verifying == 1 and rows > 256
    while core.has_unfinished():
        step()
    assert tokens == {"copy": copy_ref, "long": long_ref.token_ids}
    assert_pool_full(llm)


# -- suffix decoding and cache_salt ---------------------------------------------------------------------
def _suffix(max_cached: int = 10) -> SuffixProposer:
    return SuffixProposer(max_tree_depth=8, max_cached_requests=max_cached, max_spec_factor=4.0,
                          min_token_prob=0.1)


def _finish(p: SuffixProposer, rid: str, output: list[int], salt: str | None) -> None:
    prompt = [1, 2, 3]
    p.propose([DraftRequest(rid, prompt + output, len(prompt), 1, cache_salt=salt)])
    p.release(rid, finished=True)  # its output joins the past responses of its salt


def _draft(p: SuffixProposer, context: list[int], salt: str | None) -> list[int]:
    (d,) = p.propose([DraftRequest("q", context, 2, 4, cache_salt=salt)])
    p.release("q", finished=False)
    return d


def test_suffix_drafts_never_come_from_another_salts_outputs() -> None:
    p = _suffix()
    secret = [901, 902, 903, 904, 905, 906]
    _finish(p, "a", secret, "tenant-a")
    context = [7, 8, 901, 902]  # a new request reaching the start of tenant A's answer
    assert _draft(p, context, "tenant-a") == [903, 904, 905, 906]
    assert _draft(p, context, "tenant-b") == []
    assert _draft(p, context, None) == []
    _finish(p, "u", secret, None)  # unsalted requests share their past responses, as before
    assert _draft(p, context, None) == [903, 904, 905, 906]
    assert _draft(p, context, "tenant-b") == []


def test_suffix_past_responses_stay_bounded_across_salts() -> None:
    p = _suffix(max_cached=2)
    _finish(p, "a", [901, 902, 903], "tenant-a")
    _finish(p, "b1", [801, 802, 803], "tenant-b")
    _finish(p, "b2", [811, 812, 813], "tenant-b")  # the oldest response (tenant A's only one) goes
    assert _draft(p, [901, 902], "tenant-a") == []
    assert _draft(p, [801, 802], "tenant-b") == [803]
    assert set(p._tries) == {"tenant-b"}  # an empty salt keeps no trie behind


def test_suffix_engine_drafts_for_a_salt_as_if_no_other_salt_had_run() -> None:
    """Through the engine: tenant B, after tenant A ran the same prompts, drafts exactly as on a fresh
    engine (neither A's past responses nor A's prefix-cache blocks reach it); A's rerun drafts more."""
    ps = prompts()[:3]

    def run(llm, salt: str) -> list[tuple[list[int], int]]:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, cache_salt=salt)
        return [(o.token_ids, o.spec_num_draft_tokens) for o in llm.generate(ps, params)]

    fresh = run(spec_llm("suffix"), "tenant-b")
    llm = spec_llm("suffix")
    assert run(llm, "tenant-a") == fresh
    assert run(llm, "tenant-b") == fresh
    rerun = run(llm, "tenant-a")
    assert [t for t, _ in rerun] == [t for t, _ in fresh]
    assert sum(n for _, n in rerun) > sum(n for _, n in fresh)
    assert_pool_full(llm)
