"""`specserve train-draft` on a tiny random llama: the cut model trains (loss falls, resumable), saves a
Hugging Face-layout folder that `method: draft_model` accepts (same vocabulary and tokenizer), and greedy
output with it as the draft equals the target alone."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from engine.llm import LLM
from engine.models import adapter
from engine.models.loader import load_model
from engine.sampling import SamplingParams
from engine.training.assistant import TrainSettings
from engine.training.draft import DraftSettings, cut_model, train_draft
from tests.engine.test_models import make_tiny_folder


def _data() -> TrainSettings:
    return TrainSettings(max_tokens=16, samples_per_prompt=2, max_prompts=4, max_num_seqs=8)


def test_cut_model_keeps_the_first_layers(tmp_path: Path) -> None:
    target = load_model(str(make_tiny_folder("llama", tmp_path)), dtype="float32", progress=False)
    draft, config = cut_model(target, 1)
    assert config["num_hidden_layers"] == 1 and len(draft.model.layers) == 1
    assert mx.array_equal(draft.model.layers[0].self_attn.q_proj.weight,
                          target.model.model.layers[0].self_attn.q_proj.weight).item()
    with pytest.raises(ValueError, match="--num-layers"):
        cut_model(target, len(target.model.layers))


@pytest.mark.slow  # 45 s on 2 cores: the default suite's longest test (pytest -m slow runs it)
def test_train_resume_and_serve_as_draft(tmp_path: Path) -> None:
    target = load_model(str(make_tiny_folder("llama", tmp_path)), dtype="float32", progress=False)
    out = tmp_path / "draft"
    first = train_draft(target, out, s=DraftSettings(num_layers=1, steps=4, save_every=2),
                        data=_data(), progress=False)
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 4
    second = train_draft(target, out, s=DraftSettings(num_layers=1, steps=40, save_every=20),
                         data=_data(), progress=False)
    assert second["sequences"] == first["sequences"] == 8  # the generated text was reused
    assert second["final_loss"] < first["final_loss"]  # training went on and learned

    loaded = load_model(str(out), dtype="float32", progress=False)
    assert loaded.config["num_hidden_layers"] == 1 and loaded.vocab_size == target.vocab_size
    # Full-vocabulary top-1 agreement with the target rose with training, and the saved folder, loaded
    # back the way `draft_model` loads it, agrees as well as the model in training did.
    assert second["train_top1"] > second["start_top1"]
    seqs = [json.loads(x) for x in (out / "data" / "sequences.jsonl").read_text().splitlines()]
    hits = total = 0
    for q in seqs:
        ids = mx.array(q)[None]
        want = mx.argmax(adapter.compute_logits(target.model, target.model.model(ids)), axis=-1)
        got = mx.argmax(adapter.compute_logits(loaded.model, loaded.model.model(ids)), axis=-1)
        hits += (want == got).sum().item()
        total += len(q)
    assert hits / total > second["start_top1"] + 0.1
    kw = dict(kv_cache_memory="32MiB", max_model_len=256, block_size=8, show_progress=False)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 11]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(loaded=target, **kw).generate(prompts, greedy)]
    spec = LLM(loaded=target, speculative_config={"method": "draft_model", "model": str(out),
                                                  "num_speculative_tokens": 3}, **kw)
    outs = spec.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.spec_num_draft_tokens for o in outs) > 0
