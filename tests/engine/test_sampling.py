import math

import mlx.core as mx
import numpy as np
import pytest

from engine.sampler import filter_logits, process_logits, sample, set_global_seed
from engine.sampling import MAX_STOP_TOKEN_IDS, RowState, SamplingParams

VOCAB = 1000


def _row(params: SamplingParams, output=(), prompt=(), eos=(0,)) -> RowState:
    return RowState(params, list(output), list(prompt), list(eos))


def _logits(rng: np.random.Generator, rows: int, vocab: int = VOCAB, scale: float = 3.0) -> np.ndarray:
    return (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------------------------------------
# SamplingParams.validate
# ---------------------------------------------------------------------------------------------

INVALID = [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", math.nan),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.1),
    ("presence_penalty", math.inf),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > max_tokens (16)
    ("logprobs", -1),
    ("logprobs", 21),
    ("seed", 1 << 70),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop_token_ids", [VOCAB]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
]


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_validate_rejects(name, value):
    params = SamplingParams(**{name: value})
    with pytest.raises(ValueError, match=name):
        params.validate(VOCAB)


VALID = [
    {},
    {"temperature": 0.0},
    {"temperature": 5.0, "top_p": 1.0, "top_k": -1},
    {"top_k": 1, "top_p": 1e-6, "min_p": 1.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.3},
    {"max_tokens": None, "min_tokens": 100},
    {"max_tokens": 5, "min_tokens": 5},
    {"logprobs": 0},
    {"logprobs": 20},
    {"seed": -7},
    {"stop": ["a", "\n\n"], "stop_token_ids": [0, VOCAB - 1]},
]


@pytest.mark.parametrize("kwargs", VALID)
def test_validate_accepts(kwargs):
    SamplingParams(**kwargs).validate(VOCAB)


def test_greedy_and_spec_decode_flags():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    assert SamplingParams(temperature=0.0, seed=3, top_p=0.5).argmax_only  # argmax-invariant
    assert not SamplingParams(temperature=0.7).argmax_only
    assert not SamplingParams(temperature=0.0, presence_penalty=0.5).argmax_only
    assert not SamplingParams(temperature=0.0, repetition_penalty=1.1).argmax_only
    assert not SamplingParams(temperature=0.0, logprobs=0).argmax_only
    assert not SamplingParams(temperature=0.0, min_tokens=3).argmax_only


# ---------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_temperature_zero_matches():
    rng = np.random.default_rng(0)
    x = _logits(rng, 8)
    variants = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-7, seed=5),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9),  # filters are argmax-invariant
    ]
    for params in variants:
        out = sample(mx.array(x), [_row(params) for _ in range(8)])
        assert out.token_ids == np.argmax(x, axis=-1).tolist()
        assert out.logprobs == [None] * 8


def test_sample_does_not_modify_input_logits():
    rng = np.random.default_rng(1)
    x = _logits(rng, 2)
    logits = mx.array(x)
    rows = [_row(SamplingParams(temperature=0.0, repetition_penalty=1.5), output=[1, 2, 3])] * 2
    sample(logits, rows)
    np.testing.assert_array_equal(np.array(logits), x)


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------


def _run_steps(seed_params: SamplingParams, steps: np.ndarray, batch_extra: int) -> list[int]:
    """Sample `steps` tokens for one seeded row, placed last in a batch with `batch_extra` other rows."""
    out: list[int] = []
    rng = np.random.default_rng(99)
    for step_logits in steps:
        seeds = rng.integers(0, 100, batch_extra).tolist()
        others = [_row(SamplingParams(temperature=0.9, seed=s)) for s in seeds]
        x = np.concatenate([_logits(rng, batch_extra), step_logits[None]], axis=0)
        res = sample(mx.array(x), [*others, _row(seed_params, output=out)])
        out.append(res.token_ids[-1])
    return out


def test_seeded_sampling_reproducible_and_batch_independent():
    steps = _logits(np.random.default_rng(2), 6, scale=0.5)  # flat-ish: many plausible tokens
    params = SamplingParams(temperature=1.0, seed=1234, top_k=500)
    alone = _run_steps(params, steps, batch_extra=0)
    assert _run_steps(params, steps, batch_extra=0) == alone
    assert _run_steps(params, steps, batch_extra=3) == alone
    other_seed = _run_steps(SamplingParams(temperature=1.0, seed=4321, top_k=500), steps, batch_extra=0)
    assert other_seed != alone


def test_global_seed_makes_unseeded_rows_reproducible():
    x = mx.array(_logits(np.random.default_rng(3), 4, scale=0.5))
    rows = [_row(SamplingParams(temperature=1.0)) for _ in range(4)]
    set_global_seed(7)
    first = [sample(x, rows).token_ids for _ in range(3)]
    set_global_seed(7)
    assert [sample(x, rows).token_ids for _ in range(3)] == first
    assert len({tuple(t) for t in first}) > 1  # the stream advances between calls


# ---------------------------------------------------------------------------------------------
# Filters and distribution
# ---------------------------------------------------------------------------------------------


def _draw_many(probs: list[float], params: SamplingParams, n: int = 4000) -> np.ndarray:
    x = np.tile(np.log(np.asarray(probs, dtype=np.float32)), (n, 1))  # [n, vocab]
    return np.asarray(sample(mx.array(x), [_row(params, eos=[]) for _ in range(n)]).token_ids)


def test_top_k_one_and_tiny_top_p_are_argmax():
    rng = np.random.default_rng(4)
    x = _logits(rng, 16, scale=0.3)
    expected = np.argmax(x, axis=-1).tolist()
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        assert sample(mx.array(x), [_row(params) for _ in range(16)]).token_ids == expected


def test_distribution_matches_softmax_with_temperature():
    set_global_seed(11)
    probs = [0.1, 0.2, 0.3, 0.4]
    freq = np.bincount(_draw_many(probs, SamplingParams(temperature=1.0)), minlength=4) / 4000
    np.testing.assert_allclose(freq, probs, atol=0.03)
    sharp = np.square(probs) / np.square(probs).sum()  # temperature 0.5 squares the probabilities
    freq = np.bincount(_draw_many(probs, SamplingParams(temperature=0.5)), minlength=4) / 4000
    np.testing.assert_allclose(freq, sharp, atol=0.03)


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=3), {2, 3, 4}),
        (SamplingParams(top_p=0.65), {3, 4}),  # token 2 has 0.7 >= 0.65 mass before it
        (SamplingParams(top_p=0.75), {2, 3, 4}),
        (SamplingParams(min_p=0.6), {3, 4}),  # p >= 0.6 * 0.4
        (SamplingParams(min_p=0.3), {2, 3, 4}),
        (SamplingParams(top_k=2, top_p=0.5), {4}),  # top-k renormalises: 0.4/0.7 >= 0.5
    ],
)
def test_filters_keep_exactly_the_allowed_tokens(params, allowed):
    set_global_seed(12)
    drawn = set(_draw_many([0.05, 0.05, 0.2, 0.3, 0.4], params).tolist())
    assert drawn == allowed


def _reference_kept(x: np.ndarray, p: SamplingParams) -> set[int]:
    """NumPy (float64) reference: tokens that survive temperature, min_p, top_k, top_p."""
    x = x.astype(np.float64) / p.temperature
    if p.min_p > 0:
        x = np.where(x - x.max() < np.log(p.min_p), -np.inf, x)
    order = np.argsort(-x, kind="stable")
    k = p.top_k if 0 < p.top_k < x.size else x.size
    top = x[order[:k]]
    keep = np.isfinite(top)
    if p.top_p < 1.0:
        probs = np.exp(top - top.max())
        probs /= probs.sum()
        keep &= np.cumsum(probs) - probs < p.top_p
    return set(order[:k][keep].tolist())


@pytest.mark.parametrize(
    ("scale", "params"),
    [
        (4.0, SamplingParams(temperature=0.7, top_k=40)),
        (4.0, SamplingParams(temperature=1.3, top_k=3000)),  # above the candidate cap
        (4.0, SamplingParams(temperature=1.0, top_p=0.9)),  # peaked: nucleus inside the candidates
        (0.5, SamplingParams(temperature=1.0, top_p=0.9)),  # flat: nucleus of thousands of tokens
        (0.5, SamplingParams(temperature=0.8, top_k=2000, top_p=0.5)),
        (4.0, SamplingParams(temperature=1.0, top_k=100, top_p=0.95, min_p=0.01)),
        (2.0, SamplingParams(temperature=2.0, min_p=0.2)),
        (2.0, SamplingParams(temperature=1.0)),
    ],
)
def test_filters_match_numpy_reference_on_large_vocab(scale, params):
    x = _logits(np.random.default_rng(13), 3, vocab=5000, scale=scale)
    x[1, :10] = -np.inf  # e.g. banned by min_tokens
    filtered = np.array(filter_logits(mx.array(x), [params] * 3))
    for i in range(3):
        kept = set(np.flatnonzero(np.isfinite(filtered[i])).tolist())
        assert kept == _reference_kept(x[i], params)
    if scale == 0.5 and params.top_k == 0:
        assert len(kept) > 1024  # the exact fallback path was taken


# ---------------------------------------------------------------------------------------------
# Penalties and min_tokens
# ---------------------------------------------------------------------------------------------


def _reference_process(x: np.ndarray, row: RowState) -> np.ndarray:
    """NumPy reference for min_tokens masking + vLLM-style penalties on one row."""
    p = row.params
    x = x.copy()
    if len(row.output_token_ids) < p.min_tokens:
        for t in [*row.eos_token_ids, *p.stop_token_ids]:
            x[t] = -np.inf
    for t in set(row.prompt_token_ids) | set(row.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(row.output_token_ids):
        count = row.output_token_ids.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(5)
    x = _logits(rng, 5)
    rows = [
        _row(SamplingParams(repetition_penalty=1.3), output=[4, 4, 9], prompt=[1, 2, 9, 500]),
        _row(SamplingParams(repetition_penalty=0.7), output=[3], prompt=[3, 7]),
        _row(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), output=[6, 6, 6, 8], prompt=[11]),
        _row(
            SamplingParams(presence_penalty=-1.5, frequency_penalty=-0.25, repetition_penalty=1.2),
            output=[20, 21, 20],
            prompt=[21, 22],
        ),
        _row(SamplingParams(), output=[1, 2, 3], prompt=[4]),  # untouched
    ]
    got = np.array(process_logits(mx.array(x), rows))
    expected = np.stack([_reference_process(x[i], r) for i, r in enumerate(rows)])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    changed = np.flatnonzero(got[0] != x[0]).tolist()
    assert changed == [1, 2, 4, 9, 500]  # prompt + output tokens only
    np.testing.assert_array_equal(got[4], x[4])


def test_greedy_with_penalties_is_argmax_of_processed_logits():
    x = np.zeros((1, 8), dtype=np.float32)
    x[0, 5] = 2.0
    x[0, 6] = 1.9
    row = _row(SamplingParams(temperature=0.0, repetition_penalty=1.2), output=[5])
    assert sample(mx.array(x), [row]).token_ids == [6]  # 2.0 / 1.2 < 1.9
    row = _row(SamplingParams(temperature=0.0, frequency_penalty=0.05), output=[5])
    assert sample(mx.array(x), [row]).token_ids == [5]  # 2.0 - 0.05 > 1.9


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_suppresses_eos_and_stop_token_ids(ignore_eos):
    x = np.zeros((1, 10), dtype=np.float32)
    x[0, [2, 7, 9]] = [10.0, 9.0, 8.0]  # eos 2, stop token 7 are the favourites
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=ignore_eos)
    assert sample(mx.array(x), [_row(params, output=[1, 1], eos=[2])]).token_ids == [9]
    assert sample(mx.array(x), [_row(params, output=[1, 1, 1], eos=[2])]).token_ids == [2]
    random_params = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[7], seed=0)
    rows = [_row(random_params, output=[1] * k, eos=[2]) for k in range(3)]
    drawn = {sample(mx.array(x), [row]).token_ids[0] for row in rows}
    assert not drawn & {2, 7}


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------


def test_logprobs_match_numpy_log_softmax_of_raw_logits():
    rng = np.random.default_rng(6)
    x = _logits(rng, 4)
    x[3, 7] = 20.0  # dominant token that the penalty below would halve: raw logprobs must ignore it
    rows = [
        _row(SamplingParams(temperature=0.0, logprobs=5)),
        _row(SamplingParams(temperature=0.8, seed=3, logprobs=0)),
        _row(SamplingParams(temperature=0.0)),
        _row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0), output=[7], prompt=[8]),
    ]
    res = sample(mx.array(x), rows)
    ref = _log_softmax(x)  # raw: before penalties / temperature
    assert res.logprobs[2] is None
    for i in (0, 1, 3):
        lp = res.logprobs[i]
        assert lp is not None and lp.token_id == res.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id], abs=1e-4)
        k = rows[i].params.logprobs
        assert [t for t, _ in lp.top] == np.argsort(-ref[i])[:k].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(ref[i])[::-1][:k], atol=1e-4)
    assert res.logprobs[1].top == []
