"""Speculation on sampled requests (issue #36), through the real engine and default model:

- seeded sampled requests give plain decoding's tokens with every drafter, alone and batched;
- a verifier with randomness of its own (lossless, but not the coupled draw) does not;
- unseeded, the distribution of the first tokens matches plain decoding's (two-sample chi-square), and a
  verifier that accepts every draft fails the same test;
- with penalties and min_tokens the target rows the verifier samples are plain decoding's, row by row;
- logprobs of accepted tokens are plain decoding's.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import engine.spec.verify as verify_module
from engine.sampler import process_logits
from engine.sampling import SamplingParams
from engine.spec.rejection import RejectionConfig
from tests.helpers import CHATS, chi2_sf, make_llm

ASSISTANT = Path(__file__).resolve().parents[2] / "configs" / "assistants" / "smollm2-135m-mtp"
COPY = ("Repeat this text exactly, word for word: The quick brown fox jumps over the lazy dog near the "
        "river bank. A small bird sings on the old oak tree while the farmer walks to the market.")
SPECS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "mtp": {"method": "mtp", "model": str(ASSISTANT), "num_speculative_tokens": 2,
            "draft_sample_method": "greedy"},
}
# Drafts drawn from the assistant's distribution: lossless in distribution, not the coupled draw.
PROB_SPECS = {"mtp-prob": SPECS["mtp"] | {"draft_sample_method": "probabilistic"}}
KW = {"max_model_len": 512, "kv_cache_memory": "256MiB"}


@functools.cache
def plain_llm() -> Any:
    return make_llm(**KW)


@functools.cache
def spec_llm(method: str) -> Any:
    return make_llm(speculative_config=(SPECS | PROB_SPECS)[method], **KW)


def chat(llm: Any, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def sampled(seed: int | None, **kw: Any) -> SamplingParams:
    base = {"max_tokens": 32, "temperature": 0.8, "top_p": 0.9, "presence_penalty": 0.4, "seed": seed}
    return SamplingParams(**(base | kw))


@pytest.mark.parametrize("method", list(SPECS))
def test_seeded_sampled_requests_equal_plain_decoding_alone_and_batched(method: str) -> None:
    plain, spec = plain_llm(), spec_llm(method)
    prompts = [chat(plain, COPY), chat(plain, CHATS[3]), chat(plain, CHATS[7]), chat(plain, COPY + " Twice.")]
    params = [sampled(11 + i) for i in range(len(prompts))]
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    alone = [spec.generate([p], sp)[0] for p, sp in zip(prompts[:2], params[:2], strict=True)]
    assert [o.token_ids for o in alone] == ref[:2]
    # Batched with greedy and unseeded sampled traffic, in other orders and batch sizes.
    others = [chat(plain, c) for c in CHATS[:3]]
    mixed = spec.generate([*others, *prompts[::-1]],
                          [SamplingParams(max_tokens=32, temperature=0.0), sampled(None), sampled(None),
                           *params[::-1]])
    assert [o.token_ids for o in mixed[3:]] == ref[::-1]
    accepted = sum(o.spec_num_accepted_tokens for o in [*alone, *mixed[3:]])
    assert accepted > 0, "no draft of a sampled request was accepted: speculation did not run"
    assert not spec.core.has_unfinished()
    assert spec.core.kv.num_free_blocks == spec.core.kv.pool.num_blocks


def test_verifier_with_its_own_randomness_is_not_plain_decoding() -> None:
    """Block verification is lossless, but draws its own uniforms: seeded outputs differ from plain ones.
    This is what the coupled check above must not do."""
    plain = plain_llm()
    # drafts at every step, often rejected
    spec = make_llm(speculative_config=SPECS["mtp"] | {"rejection_sample_method": "block"}, **KW)
    assert spec.core.runner.rejection == RejectionConfig("block")
    prompts = [chat(plain, COPY), chat(plain, CHATS[3]), chat(plain, CHATS[7])]
    params = [sampled(11 + i, temperature=1.0, top_p=1.0) for i in range(len(prompts))]
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert sum(o.spec_num_draft_tokens for o in got) > 0
    assert [o.token_ids for o in got] != ref


# -- distributions (unseeded) ----------------------------------------------------------------------

def first_tokens(llm: Any, prompt: list[int], n: int, params: SamplingParams) -> Counter[tuple[int, ...]]:
    outs: list[tuple[int, ...]] = []
    for start in range(0, n, 64):
        got = llm.generate([prompt] * min(64, n - start), params)
        outs += [tuple(o.token_ids) for o in got]
    return Counter(outs)


def two_sample_pvalue(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> float:
    """Chi-square homogeneity test; categories with under 10 draws in both samples together are pooled."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    big = [k for k in keys if a[k] + b[k] >= 10]
    rows = np.array([[a[k] for k in big] + [sum(a[k] for k in keys if k not in big)],
                     [b[k] for k in big] + [sum(b[k] for k in keys if k not in big)]], dtype=np.float64)
    rows = rows[:, rows.sum(axis=0) > 0]  # [2, C]
    if rows.shape[1] < 2:
        return 1.0
    expected = rows.sum(axis=1, keepdims=True) * rows.sum(axis=0, keepdims=True) / rows.sum()
    stat = float(((rows - expected) ** 2 / expected).sum())
    return chi2_sf(stat, rows.shape[1] - 1)


N_SAMPLES = 512


@functools.cache
def plain_first_tokens(text: str, temp: float, top_p: float) -> Counter[tuple[int, ...]]:
    plain = plain_llm()
    params = SamplingParams(max_tokens=4, temperature=temp, top_p=top_p, ignore_eos=True)
    return first_tokens(plain, chat(plain, text), N_SAMPLES, params)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "text", "temp", "top_p"), [("ngram", COPY, 1.0, 1.0),
                                                                ("mtp", CHATS[1], 1.0, 1.0),
                                                                ("mtp", CHATS[1], 0.7, 0.9),
                                                                ("mtp-prob", CHATS[1], 1.0, 1.0),
                                                                ("mtp-prob", CHATS[1], 0.7, 0.9)])
def test_first_tokens_follow_plain_decodings_distribution(method: str, text: str, temp: float,
                                                          top_p: float) -> None:
    spec = spec_llm(method)
    params = SamplingParams(max_tokens=4, temperature=temp, top_p=top_p, ignore_eos=True)
    got = first_tokens(spec, chat(spec, text), N_SAMPLES, params)
    ref = plain_first_tokens(text, temp, top_p)
    p = two_sample_pvalue(ref, got)
    assert p > 1e-3, (p, ref.most_common(5), got.most_common(5))


@pytest.mark.slow
def test_a_verifier_that_accepts_every_draft_fails_the_distribution_test() -> None:
    broken = make_llm(speculative_config=SPECS["mtp"] | {"rejection_sample_method": "synthetic",
                                                         "synthetic_acceptance_rate": 1.0}, **KW)
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    bad = first_tokens(broken, chat(broken, CHATS[1]), N_SAMPLES, params)
    ref = plain_first_tokens(CHATS[1], 1.0, 1.0)
    assert two_sample_pvalue(ref, bad) < 1e-3, (ref.most_common(5), bad.most_common(5))


# -- rows and logprobs -----------------------------------------------------------------------------

def record_rows(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, ...], np.ndarray]:
    """Every row the sampler sees, processed (min_tokens, penalties), keyed by its output so far."""
    rows: dict[tuple[int, ...], np.ndarray] = {}
    real = verify_module.sample

    def recording(logits: mx.array, states: list[Any]) -> Any:
        processed = np.array(process_logits(logits, states))
        for i, st in enumerate(states):
            rows.setdefault(tuple(st.output_token_ids), processed[i])
        return real(logits, states)

    monkeypatch.setattr(verify_module, "sample", recording)
    return rows


def test_penalties_and_min_tokens_rows_equal_plain_decodings(monkeypatch: pytest.MonkeyPatch) -> None:
    plain, spec = plain_llm(), spec_llm("mtp")  # MTP drafts at every step, penalties or not
    prompt = chat(plain, COPY)
    params = SamplingParams(max_tokens=24, temperature=0.5, top_k=40, repetition_penalty=1.05,
                            frequency_penalty=0.1, presence_penalty=0.1, min_tokens=12, seed=5)
    plain_rows = record_rows(monkeypatch)
    (ref,) = plain.generate([prompt], params)
    spec_rows = record_rows(monkeypatch)
    (got,) = spec.generate([prompt], params)
    assert got.token_ids == ref.token_ids and got.spec_num_accepted_tokens > 0
    out = ref.token_ids
    for pos in range(len(out)):
        key = tuple(out[:pos])
        assert key in spec_rows, pos
        np.testing.assert_array_equal(spec_rows[key], plain_rows[key], err_msg=f"position {pos}")
    # min_tokens masked EOS at the early positions, in the drafted rows too
    eos = plain.core.loaded.eos_token_ids[0]
    assert spec_rows[tuple(out[:3])][eos] == -np.inf


def test_logprobs_of_accepted_tokens_equal_plain_decodings() -> None:
    plain, spec = plain_llm(), spec_llm("ngram")
    prompt = chat(plain, COPY)
    for params in (SamplingParams(max_tokens=24, temperature=0.0, logprobs=3),
                   SamplingParams(max_tokens=24, temperature=0.8, logprobs=2, seed=9)):
        (ref,) = plain.generate([prompt], params)
        (got,) = spec.generate([prompt], params)
        assert got.token_ids == ref.token_ids and got.spec_num_accepted_tokens > 0
        assert len(got.logprobs) == len(ref.logprobs) == len(ref.token_ids)
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_rejection_rules_report_logprobs_of_the_tokens_they_emit() -> None:
    spec = make_llm(speculative_config=SPECS["mtp"] | {"rejection_sample_method": "synthetic",
                                                       "synthetic_acceptance_rate": 0.5}, **KW)
    (out,) = spec.generate([chat(spec, CHATS[1])], SamplingParams(max_tokens=16, temperature=0.8, logprobs=2,
                                                                  seed=3, ignore_eos=True))
    assert out.spec_num_accepted_tokens > 0 and len(out.token_ids) == 16
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in out.logprobs)
