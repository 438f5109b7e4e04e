"""Probabilistic drafting (`draft_sample_method: probabilistic`, issue #36) through the real engine:

- the target as its own draft model draws drafts from q = p, so every draft is accepted, where greedy
  drafting with the coupled rule accepts far fewer (a wrong q, or drafts not drawn from it, would not);
- seeded requests replay token for token (fixed seed and configuration);
- greedy requests in the same batches still get plain greedy decoding's tokens;
- the MTP assistant draws too, and nothing it keeps outlives the requests;
- the key is validated.
The distribution of sampled outputs against plain decoding's is the slow two-sample test in
tests/spec/test_sampled_spec.py ("mtp-prob").
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from engine.sampling import SamplingParams
from engine.spec.config import SpeculativeConfigError, parse_speculative_config
from tests.helpers import CHATS, default_model, make_llm
from tests.spec.test_sampled_spec import ASSISTANT

KW = {"max_model_len": 512, "kv_cache_memory": "256MiB"}


def self_draft(method: str) -> dict[str, Any]:
    return {"method": "draft_model", "model": default_model().path, "num_speculative_tokens": 3,
            "draft_sample_method": method}


@functools.cache
def llm(kind: str) -> Any:
    spec = {"self-prob": self_draft("probabilistic"), "self-greedy": self_draft("greedy"),
            "mtp-prob": {"method": "mtp", "model": str(ASSISTANT), "num_speculative_tokens": 2,
                         "draft_sample_method": "probabilistic"}}.get(kind)
    return make_llm(speculative_config=spec, **KW)


def prompts(m: Any) -> list[list[int]]:
    return [m.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS[:3]]


def sampled(seed: int | None, **kw: Any) -> SamplingParams:
    return SamplingParams(**({"max_tokens": 24, "temperature": 1.0, "seed": seed} | kw))


def acceptance(outs: list[Any]) -> float:
    drafted = sum(o.spec_num_draft_tokens for o in outs)
    assert drafted > 0, "nothing was drafted"
    return sum(o.spec_num_accepted_tokens for o in outs) / drafted


def test_drafts_drawn_from_the_targets_own_distribution_are_all_accepted() -> None:
    params = [sampled(5 + i, top_p=0.9) for i in range(3)]
    prob = llm("self-prob").generate(prompts(llm("self-prob")), params)
    greedy = llm("self-greedy").generate(prompts(llm("self-greedy")), params)
    assert acceptance(prob) >= 0.97
    assert acceptance(greedy) < acceptance(prob) - 0.2


@pytest.mark.parametrize("kind", ["self-prob", "mtp-prob"])
def test_seeded_probabilistic_drafting_replays_and_keeps_greedy_requests_exact(kind: str) -> None:
    m, plain = llm(kind), llm("plain")
    ps = prompts(m)
    params = [sampled(21), SamplingParams(max_tokens=24, temperature=0.0), sampled(22, temperature=0.7)]
    first = m.generate(ps, params)
    again = m.generate(ps, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert first[1].token_ids == plain.generate([ps[1]], params[1])[0].token_ids
    assert first[0].spec_num_draft_tokens > 0 and first[2].spec_num_draft_tokens > 0
    assert not m.core.has_unfinished()
    assert not m.core.speculation.hidden and not m.core.scheduler.requests  # no draft state outlives them
    assert m.core.kv.num_free_blocks == m.core.kv.pool.num_blocks


def test_draft_sample_method_is_validated_and_defaults_to_greedy() -> None:
    for method in ("mtp", "draft_model"):
        cfg = parse_speculative_config({"method": method, "model": "x", "num_speculative_tokens": 1})
        assert cfg.draft_sample_method == "greedy"
    with pytest.raises(SpeculativeConfigError, match="draft_sample_method"):
        parse_speculative_config({"method": "mtp", "model": "x", "num_speculative_tokens": 1,
                                  "draft_sample_method": "nucleus"})
    with pytest.raises(SpeculativeConfigError, match="draft_sample_method: unknown key"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                  "draft_sample_method": "probabilistic"})
