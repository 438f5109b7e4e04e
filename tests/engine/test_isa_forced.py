"""Each kernel ISA this CPU runs below its best, forced with SPECSERVE_CPU_ISA (an AVX-512 machine checks
its AVX2 path this way; the best one is what every other engine test runs): the C layers run in that ISA,
greedy output with ngram and with the MTP assistant equals plain decoding at 4-bit and float32, alone and
batched, and float32 greedy output equals mlx-lm's own float32 decoding (the engine tests' reference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cpu import layers as cpu_layers
from engine.cpu.build import runnable_isas
from engine.llm import LLM
from engine.models.loader import load_model
from engine.sampling import SamplingParams
from tests.helpers import CHATS, reference_greedy

ASSISTANT = Path(__file__).resolve().parents[2] / "configs" / "assistants" / "smollm2-135m-mtp"
COPY = "Repeat the following list exactly, twice: apples, pears, plums, figs, dates, limes, kiwis, grapes."
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "mtp": {"method": "mtp", "model": str(ASSISTANT), "num_speculative_tokens": 2,
            "draft_sample_method": "greedy"},
}


@pytest.mark.parametrize("isa", runnable_isas()[1:] or [pytest.param("none", marks=pytest.mark.skip(
    reason="one kernel ISA runs here, the one every other engine test uses (auto)"))])
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_forced_isa_speculation_equals_plain(isa: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CPU_ISA", isa)
    loaded = load_model(None, dtype=dtype, progress=False)
    kw = dict(loaded=loaded, kv_cache_memory="128MiB", max_model_len=1024, show_progress=False)
    plain = LLM(**kw)
    stack = plain.core.runner.stack
    assert stack is not None and stack.lib is cpu_layers._lib(isa), "the C layers must run in the forced ISA"
    prompts = [plain.apply_chat_template([{"role": "user", "content": t}]) for t in [COPY, *CHATS[:3]]]
    want = [plain.generate([p], GREEDY)[0].token_ids for p in prompts]  # alone
    assert [o.token_ids for o in plain.generate(prompts, GREEDY)] == want  # batched
    for name, spec in SPECS.items():
        llm = LLM(speculative_config=spec, **kw)
        got = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in got] == want, f"{name} batched"
        assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts[:2]] == want[:2], f"{name} alone"
        assert sum(o.spec_num_accepted_tokens for o in got) > 0, f"{name} never had a draft accepted"
        assert llm.core.kv.num_free_blocks == llm.core.kv.pool.num_blocks
    if dtype == "float32":
        short = SamplingParams(max_tokens=24, temperature=0.0)
        for p in prompts:
            assert plain.generate([p], short)[0].token_ids == reference_greedy(loaded, p, 24)
