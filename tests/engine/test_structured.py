"""Structured outputs in the engine (engine/structured.py): masks per logits row, the matcher advanced by
accepted tokens only, drafts cut where the grammar rejects them and forced tokens drafted, matchers freed
with their requests; constrained output is the same with and without speculation, alone and batched with
unconstrained requests."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.cpu.bitmask import apply_bitmask
from engine.request import Request
from engine.runner import apply_grammar_masks
from engine.sampling import SamplingParams, StructuredOutputs
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.structured import GrammarError
from tests.helpers import chat_prompts, default_model, make_llm

SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "mood": {"enum": ["happy", "sad"]}}, "required": ["name", "age", "mood"], "additionalProperties": False})
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _compile(spec: StructuredOutputs):  # noqa: ANN202
    llm = make_llm()
    return llm.core.structured.compiler.compile(spec), llm


def test_masks_follow_drafts_and_leave_the_state_alone() -> None:
    grammar, llm = _compile(StructuredOutputs(json=SCHEMA))
    tok = llm.core.tokenizer
    ids = tok.encode('{"name": "Al", "age": 3, "mood": "sad"}', add_special_tokens=False)
    m = grammar.matcher()
    assert m.valid_prefix(ids) == len(ids)
    masks = m.masks(ids[:5])
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little", count=llm.core.loaded.vocab_size)
    assert all(bits[i, ids[i]] for i in range(5))  # each draft allowed where it stands
    assert bits[0].sum() < 10 and bits[0, tok.encode("hello", add_special_tokens=False)[0]] == 0
    assert np.array_equal(m.masks([]), masks[:1])  # nothing was consumed
    wrong = tok.encode("Sure!", add_special_tokens=False)
    assert m.valid_prefix(ids[:3] + wrong) == 3
    assert m.accept(ids) and m.stopped
    assert m.accept([llm.core.loaded.eos_token_ids[0]])  # after the end: only end-of-sequence
    assert not grammar.matcher().accept(wrong)


@pytest.mark.parametrize("use_c", [True, False], ids=["C", "NumPy"])
def test_grammar_masks_set_forbidden_tokens_to_minus_inf_in_place(use_c: bool) -> None:
    vocab = 70
    host = np.arange(3 * vocab, dtype=np.float32).reshape(3, vocab)
    before = host.copy()
    mask = np.zeros((2, 3), dtype=np.int32)  # 3 words of 32 bits
    mask[0, 0] = 1 << 5  # row 0 allows token 5
    mask[1, 2] = 1 << 1  # row 1 allows token 65
    mask[1, 0] = -1  # ... and tokens 0-31 (a word of all ones)
    apply_bitmask(host[:2], mask, use_c=use_c)
    assert np.isfinite(host[0]).sum() == 1 and host[0, 5] == before[0, 5]
    assert np.isfinite(host[1]).sum() == 33 and host[1, 65] == before[1, 65]
    assert np.array_equal(host[1, :32], before[1, :32]) and np.array_equal(host[2], before[2])
    # The runner applies each constrained request's mask to its own rows only.
    host = before.copy()
    params = SamplingParams()
    sr = ScheduledRequest("a", [1, 2], 0, [0], 2, [9], params, [1], [], [2], grammar_mask=mask)
    plain = ScheduledRequest("b", [1], 0, [1], 1, [], params, [1], [], [2])
    apply_grammar_masks(host, SchedulerOutput([plain, sr]), [1, 2])
    assert np.array_equal(host[0], before[0]) and np.isfinite(host[1]).sum() == 1


def test_forced_tokens_are_drafted_and_rejected_drafts_cut() -> None:
    grammar, llm = _compile(StructuredOutputs(choice=("the weather is sunny today", "no")))
    tok = llm.core.tokenizer
    forced = tok.encode("the weather is sunny today", add_special_tokens=False)
    req = Request("r", [1, 2, 3], SamplingParams(), 10, [2])
    llm.core.structured.add("r", grammar)
    m = llm.core.structured.matchers["r"]
    assert m.accept(forced[:1])
    req.spec_token_ids = [forced[1], 7, 8]
    llm.core.structured.fit_drafts(req, limit=0, keep=False)
    assert req.spec_token_ids == [forced[1]]  # cut at the first token the grammar rejects
    llm.core.structured.fit_drafts(req, limit=3, keep=False)
    assert req.spec_token_ids == forced[1:4]  # the only continuation, up to the limit
    req.spec_token_ids = [forced[1]]
    llm.core.structured.fit_drafts(req, limit=3, keep=True)  # a probabilistic drafter's drafts stay
    assert req.spec_token_ids == [forced[1]]
    llm.core.structured.release("r")
    assert not llm.core.structured.matchers


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_same_output_with_and_without_speculation_batched_with_plain_requests(temperature: float) -> None:
    plain, spec = make_llm(), make_llm(speculative_config=NGRAM)
    texts = ["Describe Alice, 30, who is happy, as JSON.", "Describe Bob as JSON.", "Write a haiku."]
    prompts = chat_prompts(plain, texts)
    constrained = SamplingParams(max_tokens=60, temperature=temperature, seed=5,
                                 structured=StructuredOutputs(json=SCHEMA))
    free = SamplingParams(max_tokens=20, temperature=0.0)
    params = [constrained, constrained, free]
    ref = plain.generate(prompts, params)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for o in outs[:2]:
        assert o.finish_reason == "stop" and set(json.loads(o.text)) == {"name", "age", "mood"}
    assert sum(o.spec_num_draft_tokens for o in outs[:2]) > 0
    for llm in (plain, spec):
        assert not llm.core.structured.matchers and llm.core.kv.num_free_blocks == llm.core.kv.pool.num_blocks


def test_aborted_and_invalid_requests_leave_nothing_behind() -> None:
    llm = make_llm()
    core = llm.core
    prompt = chat_prompts(llm, ["Describe Carol as JSON."])[0]
    core.add_request("x", prompt, SamplingParams(max_tokens=50, structured=StructuredOutputs(json=SCHEMA)))
    core.step()
    assert "x" in core.structured.matchers
    core.abort_request("x")
    assert not core.structured.matchers
    bad = StructuredOutputs(json='{"type": "nonsense"}')
    with pytest.raises(GrammarError, match="nonsense"):
        core.add_request("y", prompt, SamplingParams(structured=bad))
    assert not core.scheduler.requests and not core.structured.matchers
    with pytest.raises(ValueError, match="exactly one"):
        core.add_request("z", prompt, SamplingParams(structured=StructuredOutputs(regex="a", choice=("b",))))
    assert core.loaded is default_model()


def test_preempted_constrained_requests_resume_where_they_were() -> None:
    from engine.kv.cache import PagedKVCache
    from engine.models import adapter

    loaded = default_model()
    per_block = PagedKVCache.bytes_per_block(adapter.kv_layout(loaded.model).shapes, 16, loaded.dtype)
    roomy = make_llm(max_model_len=128)
    tight = make_llm(max_model_len=128, kv_cache_memory=str(8 * per_block))
    prompts = chat_prompts(roomy, [f"Describe {n} as JSON." for n in ("Alice", "Bob", "Carol", "Dan")])
    params = SamplingParams(max_tokens=60, temperature=0.0, structured=StructuredOutputs(json=SCHEMA))
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    got = tight.generate(prompts, params)
    assert tight.core.scheduler.num_preemptions > 0  # the matcher outlived its request's KV
    assert [o.token_ids for o in got] == want
    assert not tight.core.structured.matchers
