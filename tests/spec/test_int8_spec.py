"""Speculation stays exact with 8-bit activations: the default model as stored (4-bit layers, 8-bit head),
its 4-bit products taking int8 activations (`--activation-precision int8`), greedy output with ngram, the
shipped MTP assistant and draft_model equals plain decoding alone and at batch 8, seeded sampled requests
beside them included."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from engine.cpu.qgemm import int8_by_default, unsupported_reason
from engine.llm import LLM
from engine.models.loader import LoadedModel, load_model
from engine.sampling import SamplingParams
from tests.helpers import CHATS

pytestmark = pytest.mark.skipif(unsupported_reason() is not None,
                                reason=f"no C kernels here: {unsupported_reason()}")
ASSISTANT = Path(__file__).resolve().parents[2] / "configs" / "assistants" / "smollm2-135m-mtp"
COPY = ("Repeat the following text exactly, word for word.\n\nThe meeting on Monday is moved to Tuesday at "
        "ten in the morning. Please bring your reports and the budget figures for the third quarter.")
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "mtp": {"method": "mtp", "model": str(ASSISTANT), "num_speculative_tokens": 2,
            "draft_sample_method": "greedy"},
    "draft_model": {"method": "draft_model", "model": None, "num_speculative_tokens": 3,
                    "draft_sample_method": "greedy"},
}
KW = dict(kv_cache_memory="256MiB", max_model_len=1024, show_progress=False, activation_precision="int8")


@functools.cache
def stored() -> LoadedModel:
    return load_model(None, progress=False)  # the GGUF as stored: 4-bit layers


def test_int8_is_what_runs() -> None:
    llm = LLM(loaded=stored(), **KW)
    # 1 | 2: the 4-bit layers, and 8-bit products (the head) too at an explicit int8
    assert llm.core.runner.stack is not None and llm.core.runner.stack.stack.act_int8 == 3
    exact = LLM(loaded=stored(), **{**KW, "activation_precision": "float32"})
    assert exact.core.runner.stack.stack.act_int8 == 0
    auto = LLM(loaded=stored(), **{**KW, "activation_precision": "auto"})  # int8 where it is the faster
    assert auto.core.runner.stack.stack.act_int8 == int(int8_by_default())
    with pytest.raises(ValueError, match="needs 4-bit weights"):
        LLM(loaded=load_model(None, dtype="float32", progress=False), **KW)


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_speculation_equals_plain_alone_and_batched(method: str) -> None:
    plain = LLM(loaded=stored(), **KW)
    cfg = dict(METHODS[method])
    if cfg.get("model", "") is None:
        cfg["model"] = stored().path  # the target drafting for itself, as stored
    spec = LLM(loaded=stored(), speculative_config=cfg, **KW)
    prompts = [plain.apply_chat_template([{"role": "user", "content": c}]) for c in [COPY, *CHATS[:7]]]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    alone = [spec.generate([p], greedy)[0] for p in prompts[:2]]
    assert [o.token_ids for o in alone] == [plain.generate([p], greedy)[0].token_ids for p in prompts[:2]]
    params = [greedy] * 6 + [SamplingParams(max_tokens=32, temperature=0.8, seed=3 + i, ignore_eos=True)
                             for i in range(2)]
    ref, got = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert sum(o.spec_num_accepted_tokens for o in [*alone, *got]) > 0, "no draft accepted: nothing tested"
