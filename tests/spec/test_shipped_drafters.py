"""The committed drafters for the default model, the MTP assistant (configs/assistants/smollm2-135m-mtp,
written by `specserve train-assistant`) and the EAGLE-3 head (configs/assistants/smollm2-135m-eagle3,
`specserve train-eagle3`): greedy output with each at K = 1 and K = 3 equals decoding without it, at batch 1
and at batch 8 mixed with seeded sampled requests, and their drafts are accepted; the MTP assistant's C
passes draft what its MLX module drafts."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.llm import LLM
from engine.models.loader import load_model
from engine.sampling import SamplingParams
from tests.helpers import CHATS

ASSISTANTS = Path(__file__).resolve().parents[2] / "configs" / "assistants"
ASSISTANT = ASSISTANTS / "smollm2-135m-mtp"
SHIPPED = {"mtp": ASSISTANT, "eagle3": ASSISTANTS / "smollm2-135m-eagle3"}


@pytest.fixture(scope="module")
def target():  # noqa: ANN201 - LoadedModel
    return load_model(None, dtype="float32", progress=False)


@pytest.mark.parametrize("method", sorted(SHIPPED))
@pytest.mark.parametrize("k", [1, 3])
def test_shipped_drafter_is_exact_at_batch_1_and_8(target, method: str, k: int) -> None:  # noqa: ANN001
    kw = dict(kv_cache_memory="256MiB", max_model_len=1024, show_progress=False)
    plain = LLM(loaded=target, **kw)
    spec = LLM(loaded=target, speculative_config={"method": method, "model": str(SHIPPED[method]),
                                                  "num_speculative_tokens": k,
                                                  "draft_sample_method": "greedy"}, **kw)
    prompts = [plain.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS[:8]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=24, temperature=0.8, seed=7 + i, ignore_eos=True) for i in range(2)]
    # Batch 1: greedy requests alone, one after another (two: over 24 tokens one prompt may see every
    # draft rejected).
    alone = [spec.generate([p], greedy)[0] for p in prompts[:2]]
    assert [o.token_ids for o in alone] == [plain.generate([p], greedy)[0].token_ids for p in prompts[:2]]
    assert sum(o.spec_num_accepted_tokens for o in alone) > 0  # the trained drafter does predict the target
    # Batch 8: six greedy requests and two seeded sampled ones in the same steps.
    params = [greedy] * 6 + sampled
    ref, got = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert sum(o.spec_num_drafts for o in got[6:]) > 0  # sampled requests draft too, their output unchanged
    assert sum(o.spec_num_accepted_tokens for o in got[:6]) > 0


def test_min_token_prob_drafts_fewer_surer_tokens(target) -> None:  # noqa: ANN001
    """`draft_min_token_prob` cuts drafts at the assistant's unsure tokens: output unchanged, fewer draft
    tokens, a larger share of them accepted."""
    kw = dict(kv_cache_memory="256MiB", max_model_len=1024, show_progress=False)
    plain = LLM(loaded=target, **kw)
    prompts = [plain.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS[:4]]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, greedy)]
    counts = []
    for cut in (0.0, 0.4):
        spec = LLM(loaded=target, speculative_config={"method": "mtp", "model": str(ASSISTANT),
                                                      "num_speculative_tokens": 3,
                                                      "draft_min_token_prob": cut}, **kw)
        outs = [spec.generate([p], greedy)[0] for p in prompts]
        assert [o.token_ids for o in outs] == ref
        counts.append((sum(o.spec_num_draft_tokens for o in outs),
                       sum(o.spec_num_accepted_tokens for o in outs)))
    (made0, acc0), (made, acc) = counts
    assert 0 < made < made0 and acc / made > acc0 / made0, counts


def _drafting_core(target, params: list[SamplingParams] | None = None):  # noqa: ANN001, ANN202
    """An MTP engine core with 8 chat requests prefilled, its proposer, and one DraftRequest (K = 3) per
    request at its first token (with `params`' sampling settings)."""
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.llm import chat_prompt_ids
    from engine.spec.proposer import DraftRequest

    core = EngineCore(EngineConfig(kv_cache_memory="256MiB", max_model_len=1024, show_progress=False,
                                   speculative_config={"method": "mtp", "model": str(ASSISTANT),
                                                       "num_speculative_tokens": 3}), loaded=target)
    prop = core.speculation.proposer
    if prop.cpu is None:
        pytest.skip(f"C assistant pass not used here: {prop.cpu_reason}")
    prompts = [chat_prompt_ids(core.tokenizer, [{"role": "user", "content": c}]) for c in CHATS[:8]]
    first: dict[str, int] = {}
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", list(p), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while len(first) < len(prompts):  # prefill steps: each last row samples the request's first token
        outs, _ = core.step()
        for o in outs:
            first.setdefault(o.request_id, o.new_token_ids[0])
    reqs = [DraftRequest(f"r{i}", [*p, first[f"r{i}"]], len(p), 3, core.kv.block_table(f"r{i}"),
                         params=params[i] if params else None, hidden=core.speculation.hidden[f"r{i}"])
            for i, p in enumerate(prompts)]
    return core, prop, prompts, reqs


def test_c_pass_drafts_what_the_mlx_module_drafts(target) -> None:  # noqa: ANN001
    """engine/cpu/mtp.c against the MLX module on real states of the default model: the same drafts
    (K = 3) for 8 requests drafted together and one at a time, with and without cut-offs."""
    from engine.spec.proposer import DraftRequest

    core, prop, prompts, reqs = _drafting_core(target)
    for cuts in (0.0, [0.3, 0.15]):
        prop.cuts = cuts if isinstance(cuts, list) else [cuts]
        batch_c = prop.draft(reqs)[0]
        batch_mlx = prop.draft(reqs, keep_logits=True)[0]  # the MLX module (it returns logits)
        assert batch_c == batch_mlx, cuts
        assert [prop.draft([r])[0][0] for r in reqs] == batch_c
        lengths = [len(d) for d in batch_c]
        assert max(lengths) == 3 and (cuts == 0.0 or min(lengths) < 3), lengths
    # A block table too short for the position (never expected) drafts nothing instead of reading past it.
    r, block_size = reqs[0], core.runner.kv.block_size
    assert r.block_table is not None and len(r.token_ids) > 2 * block_size
    short = DraftRequest(r.request_id, r.token_ids, r.num_prompt_tokens, 3, r.block_table[:1],
                         hidden=r.hidden)
    prop.cuts = [0.0]  # no cut-off could hide drafts made from a read past the table
    assert prop.draft([short])[0] == [[]]
    for i in range(len(prompts)):
        core.abort_request(f"r{i}")
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks


def test_c_passes_draw_what_the_mlx_module_draws(target) -> None:  # noqa: ANN001
    """Probabilistic drafting through the C passes (mtp_step, tokens drawn in Python) against the MLX
    module: the same seeded draws and distributions q for sampled requests, the argmax for greedy ones,
    with and without cut-offs."""
    import numpy as np

    params = [SamplingParams(temperature=1.0, top_p=0.9 if i % 4 == 1 else 1.0, seed=40 + i) if i % 2
              else SamplingParams(temperature=0.0) for i in range(8)]
    core, prop, prompts, reqs = _drafting_core(target, params)
    prop.probabilistic = True
    for cuts in (0.0, [0.3, 0.15]):
        prop.cuts = cuts if isinstance(cuts, list) else [cuts]
        batch_c, q_c = prop.draft(reqs)[0], prop.draft_probs()
        batch_mlx, q_mlx = prop.draft(reqs, keep_logits=True)[0], prop.draft_probs()
        assert batch_c == batch_mlx, cuts
        assert sorted(q_c) == sorted(q_mlx) == sorted(f"r{i}" for i in range(8) if i % 2 and batch_c[i])
        for rid, q in q_c.items():
            d = batch_c[int(rid[1:])]
            assert q.shape == (len(d), core.loaded.vocab_size)
            np.testing.assert_allclose(q, q_mlx[rid], atol=1e-4)
            np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-4)
            assert all(q[j, t] > 0 for j, t in enumerate(d))
        greedy = [i for i in range(8) if i % 2 == 0]
        prop.probabilistic = False
        argmax = prop.draft([reqs[i] for i in greedy])[0]
        prop.probabilistic = True
        assert [batch_c[i] for i in greedy] == argmax
    for i in range(len(prompts)):
        core.abort_request(f"r{i}")
