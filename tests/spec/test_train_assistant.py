"""`specserve train-assistant` on a tiny random llama: data from the real engine, resumable training,
and a checkpoint that `method: mtp` loads and serves with exact greedy output."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.llm import LLM
from engine.models.loader import load_model
from engine.models.mtp_assistant import load_assistant
from engine.sampling import SamplingParams
from engine.training.assistant import (
    TrainSettings,
    _batch,
    _net_and_optimizer,
    agreement,
    chat_length,
    given,
    head_rows,
    init_from_target,
    settings_from_args,
    target_features,
    train_assistant,
)
from engine.training.draft import DraftSettings
from tests.engine.test_models import make_tiny_folder


def _settings(steps: int) -> TrainSettings:
    return TrainSettings(max_tokens=12, samples_per_prompt=2, head_size=256, steps=steps, batch_size=2,
                         save_every=3, max_prompts=3, eval_every=2, eval_fraction=0.5, answer_only=True)


def test_only_answer_positions_are_scored() -> None:
    """Query index j predicts position p = j + 1; with the answer starting at position 4, only p >= 4
    count (first draft), and the second draft's mask is the first's shifted by one position."""
    f = {"tokens": mx.array([1, 2, 3, 4, 5, 6]), "hidden": mx.zeros((6, 4)), "keys": mx.zeros((1, 6, 2)),
         "values": mx.zeros((1, 6, 2)), "labels": mx.array([2, 3, 4, 5, 6, 49]), "start": 4}
    index = {t: t for t in range(40)}  # label 49 is outside the head vocabulary
    _, _, _, _, m, _, ym, _, _, m2 = _batch([f], nn.Embedding(50, 4), index, mx.zeros((40, 4)), None)
    assert m.tolist() == [[0.0, 0.0, 0.0, 1.0, 1.0]]
    assert ym.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
    assert m2.tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0]]
    whole = dict(f, start=1)  # every position (the default)
    assert _batch([whole], nn.Embedding(50, 4), index, mx.zeros((40, 4)), None)[4].tolist() == [[1.0] * 5]


def test_train_resume_and_serve(tmp_path: Path) -> None:
    target = load_model(str(make_tiny_folder("llama", tmp_path)), dtype="float32", progress=False)
    out = tmp_path / "assistant"
    first = train_assistant(target, out, s=_settings(3), progress=False)
    assert first["sequences"] == 6 and first["head_size"] <= 256 and first["answer_only"]
    # The answer starts where the engine's own chat template ends.
    llm = LLM(loaded=target, kv_cache_memory="32MiB", max_model_len=256, block_size=8, show_progress=False)
    assert chat_length(target, "hi") == len(llm.apply_chat_template([{"role": "user", "content": "hi"}]))
    # Half the sequences are held out and measured at steps 2 and 3; the best step's weights are kept.
    assert first["held_out_sequences"] == 3 and set(first["held_out_top1"]) == {"2", "3"}
    assert all(0.0 <= v <= 1.0 for v in first["held_out_top1"].values())
    assert first["held_out_top1"][str(first["kept_step"])] == max(first["held_out_top1"].values())
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 3
    before = mx.load(str(out / "checkpoint" / "model.safetensors"))["self_attn.q_proj.weight"]
    mx.eval(before)  # mx.load is lazy: read it before the file is rewritten
    # Resume: reuses the generated data and continues from step 3 to 6.
    second = train_assistant(target, out, s=_settings(6), progress=False)
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 6
    assert second["sequences"] == 6
    after = mx.load(str(out / "checkpoint" / "model.safetensors"))["self_attn.q_proj.weight"]
    assert not mx.array_equal(before, after).item()  # training went on

    # --init: a new run starts from the trained assistant (weights and head vocabulary); zero steps write
    # the same tensors back.
    again = tmp_path / "init"
    train_assistant(target, again, s=replace(_settings(0), init=out, max_prompts=2), progress=False)
    was, now = mx.load(str(out / "model.safetensors")), mx.load(str(again / "model.safetensors"))
    assert set(was) == set(now)
    for name in was:
        assert mx.array_equal(was[name], now[name]).item(), name
    # From --init the rate warms up (full-rate first Adam steps scramble a trained assistant); a fresh
    # assistant starts at the full rate, as before.
    layer = len(target.model.layers) - 1
    s = replace(_settings(1000), init=out)
    assert _net_and_optimizer(target, again, [1, 2], layer, s)[1].learning_rate.item() < s.lr / 50
    fresh = _net_and_optimizer(target, tmp_path / "fresh", [1, 2], layer, _settings(1000))[1]
    assert fresh.learning_rate.item() == pytest.approx(s.lr)

    assistant = load_assistant(str(out), target)
    assert assistant.target_layers == [len(target.model.layers) - 1]
    # Held-out first drafts per draft_min_token_prob: all at 0, fewer (never more) as the cut-off rises.
    made = [v[0] for v in second["held_out_by_min_token_prob"].values()]
    assert made[0] == 1.0 and made == sorted(made, reverse=True)
    kw = dict(kv_cache_memory="32MiB", max_model_len=256, block_size=8, show_progress=False)
    plain = LLM(loaded=target, **kw)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 11]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, greedy)]
    for k in (1, 3):
        spec = LLM(loaded=target, speculative_config={"method": "mtp", "model": str(out),
                                                      "num_speculative_tokens": k}, **kw)
        outs = spec.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == ref
        assert sum(o.spec_num_draft_tokens for o in outs) > 0



def test_agreement_counts_only_drafts_above_the_cut(tmp_path: Path) -> None:
    """`agreement` (the summary's held-out figures): with cut-off 0 every scored position drafts; a cut-off
    between the assistant's probabilities drafts some; one above them all drafts none. Drafts at a cut-off
    are a subset of those at 0, so they never hold more agreeing tokens."""
    target = load_model(str(make_tiny_folder("llama", tmp_path)), dtype="float32", progress=False)
    layer = len(target.model.layers) - 1
    feats = target_features(target, [[5, 6, 7, 8, 9, 10, 11, 12], [100, 200, 300, 400, 500]], layer, [3, 1])
    head = sorted({t for f in feats for t in f["labels"].tolist()})
    net = init_from_target(target, head, layer)
    args = (target.model.model.embed_tokens, {t: i for i, t in enumerate(head)},
            head_rows(target, mx.array(head, dtype=mx.int32)), None)
    b = _batch(feats, *args)
    logits, _ = net.train_logits(b[0], b[1], b[2])
    probs = sorted(p for p, m in zip(mx.softmax(logits, axis=-1).max(axis=-1).reshape(-1).tolist(),
                                     b[4].reshape(-1).tolist(), strict=True) if m)
    assert len(probs) == 5 + 4  # positions 3..7 of the first sequence, 1..4 of the second
    (made0, top0), (made, top), none = agreement(net, feats, *args,
                                                 cuts=(0.0, (probs[3] + probs[4]) / 2, probs[-1] * 1.01))
    assert made0 == 1.0
    assert made == 5 / 9 and top * made <= top0 + 1e-9
    assert none == (0.0, 0.0)


def test_init_cuts_the_mlp_to_its_strongest_neurons(tmp_path: Path) -> None:
    """`intermediate_size` keeps the target layer's MLP neurons with the largest |gate| * |up| * |down|
    norms, in their order: the assistant's MLP then computes the target MLP's sum over exactly those
    neurons. The default is a sixth of the target's width; the full width is the target's MLP itself; zero and
    wider than the target are refused."""
    target = load_model(str(make_tiny_folder("llama", tmp_path)), dtype="float32", progress=False)
    layer = len(target.model.layers) - 1
    src = target.model.model.layers[layer].mlp
    width = src.gate_proj.weight.shape[0]
    head = list(range(16))
    x = mx.random.normal((3, target.model.args.hidden_size), key=mx.random.key(1))
    full = init_from_target(target, head, layer, width)
    assert full.config["intermediate_size"] == width
    np.testing.assert_allclose(np.array(full.mlp(x)), np.array(src(x)), rtol=1e-5, atol=1e-6)
    assert init_from_target(target, head, layer).config["intermediate_size"] == max(1, width // 6)
    n = width // 4
    cut = init_from_target(target, head, layer, n)
    score = np.array(mx.linalg.norm(src.gate_proj.weight, axis=1) * mx.linalg.norm(src.up_proj.weight, axis=1)
                     * mx.linalg.norm(src.down_proj.weight, axis=0))
    keep = np.sort(np.argsort(-score)[:n])
    act = np.array(nn.silu(src.gate_proj(x)) * src.up_proj(x))[:, keep]
    want = act @ np.array(src.down_proj.weight)[:, keep].T
    assert cut.config["intermediate_size"] == n and cut.mlp.gate_proj.weight.shape == (n, x.shape[1])
    np.testing.assert_allclose(np.array(cut.mlp(x)), want, rtol=1e-4, atol=1e-5)
    for bad in (0, width + 1):
        with pytest.raises(ValueError, match="intermediate_size"):
            init_from_target(target, head, layer, bad)


def test_served_first_draft_is_the_training_forward_argmax(tmp_path: Path) -> None:
    """The serving path (query-only attention over the paged KV, the head's argmax mapped to token ids
    through `vocab_ids`) drafts what the training path scores: at the position after each prompt, the
    proposer's first draft is the training forward's argmax, mapped. The head's rows are a shuffled
    vocabulary subset, so an unmapped (row index) or mis-mapped draft fails."""
    import random

    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.models.mtp_trained import save_trained
    from engine.spec.proposer import DraftRequest

    target = load_model(str(make_tiny_folder("llama", tmp_path)), dtype="float32", progress=False)
    layer = len(target.model.layers) - 1
    head = random.Random(0).sample(range(target.vocab_size), 96)
    net = init_from_target(target, head, layer)
    folder = tmp_path / "asst"
    save_trained(net, folder, dtype=mx.float32)
    core = EngineCore(EngineConfig(kv_cache_memory="32MiB", max_model_len=256, block_size=8,
                                   show_progress=False, speculative_config={
                                       "method": "mtp", "model": str(folder), "num_speculative_tokens": 1}),
                      loaded=target)
    args = (target.model.model.embed_tokens, {t: i for i, t in enumerate(head)},
            head_rows(target, mx.array(head, dtype=mx.int32)), None)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100, 200, 300], [42] * 19]
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        core.add_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        outs, _ = core.step()  # the prefill: its last row samples the first token
        (first,) = [o.new_token_ids[0] for o in outs if o.request_id == rid]
        seq = prompt + [first]
        draft_req = DraftRequest(rid, seq, len(prompt), 1, core.kv.block_table(rid),
                                 hidden=core.speculation.hidden.get(rid))
        (served,) = core.speculation.proposer.draft([draft_req])[0]
        b = _batch(target_features(target, [seq], layer), *args)
        logits, _ = net.train_logits(b[0], b[1], b[2])
        assert served == [head[int(mx.argmax(logits[0, -1]).item())]]  # query index -1: position len(prompt)
        core.abort_request(rid)
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks


def test_metrics_per_position_agree_with_benchmark_counts(tmp_path: Path) -> None:
    """Through the real server: /metrics per-position counters equal the counts that `specserve bench
    offline` (loadtests/offline.py) collects from the engine's stats, for the same greedy requests run one
    at a time (tiny target + an assistant trained for a few steps)."""
    import httpx

    from loadtests.offline import run_batch
    from tests.conftest import run_server
    from tests.server.api.test_server_spec import spec_counters

    target = load_model(str(make_tiny_folder("llama", tmp_path)), dtype="float32", progress=False)
    out = tmp_path / "assistant"
    train_assistant(target, out, s=_settings(4), progress=False)
    cfg = {"method": "mtp", "model": str(out), "num_speculative_tokens": 3}
    kw = dict(kv_cache_memory="32MiB", max_model_len=256, block_size=8)
    llm = LLM(loaded=target, speculative_config=cfg, show_progress=False, **kw)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 11]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    bench = [run_batch(llm, [p], greedy, f"b{i}") for i, p in enumerate(prompts)]
    per_pos = [sum(b["spec"]["accepted_per_position"][i] for b in bench
                   if i < len(b["spec"]["accepted_per_position"])) for i in range(3)]
    drafts = sum(b["spec"]["num_drafts"] for b in bench)
    assert drafts > 0
    with run_server(target, speculative_config=cfg, **kw) as srv:
        for p in prompts:
            r = httpx.post(srv.base_url + "/completions", json={
                "model": srv.client.model_name, "prompt": p, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}, timeout=120)
            assert r.status_code == 200, r.text
        got = spec_counters(srv.url)
    assert got["vllm:spec_decode_num_drafts_total"] == drafts
    accepted = sum(b["spec"]["num_accepted_tokens"] for b in bench)
    assert got["vllm:spec_decode_num_accepted_tokens_total"] == accepted
    key = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [got.get(f"{key}[{i}]", 0.0) for i in range(3)] == per_pos


def test_cli_defaults_are_the_settings_defaults() -> None:
    """Flags left out take TrainSettings' / DraftSettings' defaults (their one home); given flags win and
    `--max-prompts 0` means every prompt."""
    from server.cli import build_parser

    parser = build_parser()
    assert settings_from_args(parser.parse_args(["train-assistant", "--out", "d"])) == TrainSettings()
    flags = ["--steps", "7", "--max-prompts", "0", "--head-size", "64", "--answer-only"]
    s = settings_from_args(parser.parse_args(["train-assistant", "--out", "d", *flags]))
    assert (s.steps, s.max_prompts, s.head_size, s.answer_only) == (7, None, 64, True)
    draft = parser.parse_args(["train-draft", "--out", "d"])
    assert given(draft, "num_layers", "steps", "seed", "max_tokens", "max_prompts") == {}
    draft = parser.parse_args(["train-draft", "--out", "d", "--num-layers", "2", "--max-prompts", "5"])
    assert DraftSettings(**given(draft, "num_layers", "steps")) == DraftSettings(num_layers=2)
    assert given(draft, "max_prompts") == {"max_prompts": 5}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - (LoadedModel, Path)
    """A tiny llama target (4 heads, 2 KV heads, head_dim 16, hidden 64) and a valid trained assistant."""
    from engine.models.mtp_trained import save_trained

    root = tmp_path_factory.mktemp("pair")
    target = load_model(str(make_tiny_folder("llama", root)), dtype="float32", progress=False)
    net = init_from_target(target, list(range(100, 196)), len(target.model.layers) - 1)
    save_trained(net, root / "assistant", dtype=mx.float32)
    return target, root / "assistant"


def _set(weights: dict, key: str, value: object) -> None:
    weights[key] = value


# (what is corrupted, edit of (config, weights), words the refusal must contain: the field and both values)
CORRUPT = {
    "kv heads": (lambda c, w: c.update(num_key_value_heads=1), ["num_key_value_heads", " 1 ", "target 2"]),
    "hidden size": (lambda c, w: c.update(hidden_size=32),
                    ["pre_projection.weight", "hidden_size", "(64, 128)", "(32, 128)"]),
    "head size": (lambda c, w: c.update(head_size=95), ["head.weight", "head_size", "(96, 64)", "(95, 64)"]),
    "config field missing": (lambda c, w: c.pop("head_dim"), ["head_dim"]),
    "vocab id past the vocabulary": (lambda c, w: _set(w, "vocab_ids", mx.concatenate(
        [mx.array([49152], dtype=mx.int32), w["vocab_ids"][1:]])), ["vocab_ids", "49152", "[0, 49152)"]),
    "negative vocab id": (lambda c, w: _set(w, "vocab_ids", mx.concatenate(
        [w["vocab_ids"][:3], mx.array([-5], dtype=mx.int32), w["vocab_ids"][4:]])), ["vocab_ids", "-5"]),
    "float vocab ids": (lambda c, w: _set(w, "vocab_ids", w["vocab_ids"].astype(mx.float32)),
                        ["vocab_ids", "float32", "integer"]),
    "vocab ids missing": (lambda c, w: w.pop("vocab_ids"), ["vocab_ids"]),
    "weight of the wrong shape": (lambda c, w: _set(w, "mlp.up_proj.weight", mx.zeros((22, 64))),
                                  ["mlp.up_proj.weight", "(22, 64)", "(21, 64)", "intermediate_size"]),
    "missing weight": (lambda c, w: w.pop("mlp.down_proj.weight"), ["mlp.down_proj.weight", "lacks"]),
    "extra weight": (lambda c, w: _set(w, "mlp.extra.weight", mx.zeros((4, 4))), ["mlp.extra.weight"]),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_checkpoint_is_refused_at_load(tiny_pair, tmp_path: Path, case: str) -> None:  # noqa: ANN001
    """One thing wrong at a time in a valid checkpoint: refused at load with the field and both values
    named, before anything reaches the C draft loop (which indexes the target's KV and embedding)."""
    from engine.models.mtp_assistant import MTPAssistantError

    target, valid = tiny_pair
    assert load_assistant(str(valid), target).head_token_ids is not None  # the uncorrupted one loads
    edit, words = CORRUPT[case]
    config = json.loads((valid / "config.json").read_text())
    weights = dict(mx.load(str(valid / "model.safetensors")))
    edit(config, weights)
    bad = tmp_path / "assistant"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(bad / "model.safetensors"), weights)
    with pytest.raises(MTPAssistantError) as err:
        load_assistant(str(bad), target)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    if case == "kv heads":  # the engine refuses to start: no fallback to plain decoding
        with pytest.raises(ValueError, match="num_key_value_heads"):
            LLM(loaded=target, speculative_config={"method": "mtp", "model": str(bad)},
                kv_cache_memory="16MiB", max_model_len=256, block_size=8, show_progress=False)
