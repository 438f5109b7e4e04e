"""Structured outputs in the engine (engine/structured.py): masks per logits row, the matcher advanced by
accepted tokens only, drafts cut where the grammar rejects them and forced tokens drafted, matchers freed
with their requests; constrained output is the same with and without speculation, alone and batched with
unconstrained requests."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from engine.cpu.bitmask import apply_bitmask
from engine.request import Request
from engine.runner import ModelRunner, apply_grammar_masks
from engine.sampling import SamplingParams, StructuredOutputs
from engine.step import ScheduledRequest, SchedulerOutput
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
    assert np.array_equal(m.mask_after(ids[:5]), masks[5:6])  # one row, as masks() fills it
    assert not m.mask_after(ids[:3] + wrong).any() and not m.allows_after(ids[:3] + wrong, ids[3])
    assert m.allows_after(ids[:3], ids[3]) and not m.allows_after(ids[:3], wrong[0])
    assert np.array_equal(m.masks([]), masks[:1])  # still nothing consumed
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
    sr = ScheduledRequest("a", [1, 2], 0, [0], 2, [9], params, [1], [], [2], grammar=_FixedMasks(mask))
    plain = ScheduledRequest("b", [1], 0, [1], 1, [], params, [1], [], [2])
    apply_grammar_masks(host, SchedulerOutput([plain, sr]), [False, True])
    assert np.array_equal(host, before)  # a lazy request's rows wait for its argmax
    apply_grammar_masks(host, SchedulerOutput([plain, sr]), [False, False])
    assert np.array_equal(host[0], before[0]) and np.isfinite(host[1]).sum() == 1


class _FixedMasks:
    """What apply_grammar_masks reads of a GrammarRows, for hand-made masks."""

    def __init__(self, masks: np.ndarray) -> None:
        self._masks = masks

    def masks(self) -> np.ndarray:
        return self._masks


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


ORDER = json.dumps({"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer"},
        "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"]}},
    "customer": {"type": "string"}, "paid": {"type": "boolean"}}, "required": ["items", "customer", "paid"]})


@pytest.mark.parametrize("schema", [SCHEMA, ORDER], ids=["person", "order"])
def test_allowed_without_a_mask_is_what_the_mask_allows(schema: str) -> None:
    """GrammarMatcher.allows_after (what lazy masking decides by) against the filled masks, at every state
    of random walks through the grammar, after a prefix of two tokens: each token it allows the mask keeps
    (the exactness of lazy masking), and each the mask keeps it allows but end-of-sequence. Where the
    grammar forces text the mask keeps only its own first token, not another spelling of it."""
    grammar, llm = _compile(StructuredOutputs(json=schema))
    tok, vocab = llm.core.tokenizer, llm.core.loaded.vocab_size
    eos = set(llm.core.loaded.eos_token_ids)
    blank = {t for t in range(vocab) if not tok.decode([t]).strip()}
    forced_states = respelled = 0
    for walk in range(3):
        rng = random.Random(walk)
        history: list[int] = []
        for _ in range(80):
            m = grammar.matcher()
            assert m.accept(history[:-2])
            prefix = history[-2:]
            mask = m.mask_after(prefix).view(np.uint8)
            bits = np.unpackbits(mask, axis=1, bitorder="little", count=vocab)[0]
            allowed = np.flatnonzero(bits).tolist()
            probe = set(allowed[:40]) | set(rng.sample(range(vocab), 100)) | eos
            here = grammar.matcher()
            assert here.accept(history)
            forced = here.forced()
            if forced:
                forced_states += 1
                text = tok.decode(forced[:1])
                other = tok.encode(text[:1], add_special_tokens=False)[:1]  # the forced text, spelled shorter
                if len(text) > 1 and other and other[0] != forced[0]:
                    probe.add(other[0])
                    respelled += 1
            for t in probe:
                says = m.allows_after(prefix, t)
                assert not says or bits[t], (t, tok.decode([t]))
                assert says or not bits[t] or t in eos, (t, tok.decode([t]))
            if len(allowed) == 1 and allowed[0] in eos:
                break
            history.append(rng.choice([t for t in allowed if t not in blank] or allowed))
    assert forced_states and respelled  # the forced case was checked


def test_lazy_masks_give_the_masked_tokens_with_fewer_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constrained greedy with masks filled only where a row's argmax is not allowed equals the same with
    every row masked first, with and without ngram drafts, batched with a plain request; and fills far
    fewer masks."""
    from engine.structured import GrammarMatcher

    filled = {"rows": 0}
    masks, mask_after = GrammarMatcher.masks, GrammarMatcher.mask_after

    def count_masks(self: GrammarMatcher, drafts: list[int]) -> np.ndarray:
        filled["rows"] += len(drafts) + 1
        return masks(self, drafts)

    def count_mask_after(self: GrammarMatcher, prefix: list[int]) -> np.ndarray:
        filled["rows"] += 1
        return mask_after(self, prefix)

    monkeypatch.setattr(GrammarMatcher, "masks", count_masks)
    monkeypatch.setattr(GrammarMatcher, "mask_after", count_mask_after)
    texts = ["Describe Alice, 30, who is happy, as JSON.", "Write an order for two mugs as JSON.",
             "Describe Bob as JSON.", "Write a haiku."]
    params = [SamplingParams(max_tokens=80, temperature=0.0, structured=StructuredOutputs(json=s))
              for s in (SCHEMA, ORDER, SCHEMA)]
    params.append(SamplingParams(max_tokens=20, temperature=0.0))
    for spec in (None, NGRAM):
        runs = {}
        for lazy in (False, True):
            monkeypatch.setattr(ModelRunner, "lazy_grammar_masks", lazy)
            llm = make_llm(speculative_config=spec)
            filled["rows"] = 0
            outs = llm.generate(chat_prompts(llm, texts), params)
            runs[lazy] = ([o.token_ids for o in outs], filled["rows"])
            assert all(o.finish_reason in ("stop", "length") for o in outs)
            json.loads(outs[0].text)
        assert runs[True][0] == runs[False][0]
        assert runs[True][1] < runs[False][1] / 3, (runs[True][1], runs[False][1])
