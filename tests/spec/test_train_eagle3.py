"""`specserve train-eagle3` on a tiny random llama (8 layers: aux layers 2, 4, 5): the saved head loads and
serves with plain decoding's greedy output, training lowers the loss and raises top-1, it resumes, the
training forward is the serving head's pass (logits of the catch-up rows, and every draft of the engine's
proposer), and the command line parses."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.attention.types import build_metadata
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cpu.host import int_list
from engine.llm import LLM
from engine.models import adapter
from engine.models.eagle3 import load_eagle3, read_config
from engine.models.loader import LoadedModel, load_model
from engine.sampling import SamplingParams
from engine.spec.proposer import DraftRequest
from engine.training.assistant import TrainSettings, chat_length, read_prompts
from engine.training.eagle3 import (
    Eagle3Settings,
    Teacher,
    head_config,
    load_head,
    narrowed_head,
    new_head,
    output_rows,
    save_head,
    sequence_features,
    settings_from_args,
    train_eagle3,
    ttt_logits,
    ttt_loss,
)
from tests.engine.test_models import TINY, make_tiny_folder

AUX = (2, 4, 5)  # (2, L // 2, L - 3) for 8 layers
STEPS = 40
WORDS = ["the", "a", "sea", "sky", "blue", "red", "cat", "dog", "run", "write", "poem", "list", "why", "how"]
KW: dict[str, Any] = {"kv_cache_memory": "32MiB", "max_model_len": 256, "block_size": 8,
                      "show_progress": False}


def _settings(steps: int = STEPS) -> Eagle3Settings:
    # Fewer draft-vocabulary tokens than the answers hold: d2t maps, and some argmaxes fall outside.
    return Eagle3Settings(max_sequences=None, max_new_tokens=24, draft_vocab_size=256, steps=steps,
                          batch_size=4, lr=3e-3, warmup=2, save_every=10, eval_every=10, max_num_seqs=16)


def test_head_config_takes_the_width_given_and_refuses_zero(tiny: tuple[LoadedModel, Path],
                                                           tmp_path: Path) -> None:
    """A fresh head's MLP width: the target's when none is given, the one given, and 0 refused (it once
    meant the target's width, silently); aux layers other than three are refused before any data is made."""
    target, root = tiny
    with pytest.raises(ValueError, match="reads 3 aux layers"):
        train_eagle3(target, tmp_path / "two", root / "none.jsonl", None,
                     replace(_settings(), aux_layer_ids=(2, 4)), progress=False)
    assert not (tmp_path / "two" / "data").exists()
    width = int(target.model.args.intermediate_size)
    assert head_config(target, 32, AUX, 3)["transformer_layer_config"]["intermediate_size"] == width
    assert head_config(target, 32, AUX, 3, 8)["transformer_layer_config"]["intermediate_size"] == 8
    with pytest.raises(ValueError, match="intermediate_size must be >= 1"):
        head_config(target, 32, AUX, 3, 0)
    for settings in (Eagle3Settings, TrainSettings):  # both trainers' flags, before any data is made
        with pytest.raises(ValueError, match="intermediate_size must be >= 1"):
            settings(intermediate_size=0)


def _prompts(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(6))}) + "\n"
                            for _ in range(n)))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Path]:
    root = tmp_path_factory.mktemp("eagle3-train")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(TINY, "llama", {**TINY["llama"], "num_hidden_layers": 8})
        folder = make_tiny_folder("llama", root)
    return load_model(str(folder), dtype="float32", progress=False), root


@pytest.fixture(scope="module")
def trained(tiny: tuple[LoadedModel, Path]) -> tuple[LoadedModel, Path, dict]:
    target, root = tiny
    out = root / "head"
    summary = train_eagle3(target, out, _prompts(root / "train.jsonl", 12, 0),
                           _prompts(root / "held.jsonl", 4, 1), _settings(), progress=False)
    return target, out, summary


Trained = tuple[LoadedModel, Path, dict]


def test_saved_head_loads_and_serves_with_plain_greedy_output(trained: Trained) -> None:
    target, out, _ = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 256
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(AUX) and cfg["norm_before_residual"] is True
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    tensors = mx.load(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and tensors["d2t"].dtype == mx.int64
    loaded = load_eagle3(str(out), target)
    assert loaded.aux_layer_ids == AUX and loaded.head.d2t is not None
    vocab = np.arange(256) + np.array(tensors["d2t"])
    assert (np.diff(vocab) > 0).all() and vocab[-1] < target.vocab_size  # ascending target ids
    # The frozen lm_head is the target's output rows for the draft vocabulary.
    np.testing.assert_allclose(np.array(tensors["lm_head.weight"].astype(mx.float32)),
                               np.array(target.model.lm_head.weight[mx.array(vocab)]), rtol=1e-3, atol=1e-3)
    # The draft vocabulary holds the answers' repeated tokens (fewer than 256 of them).
    seqs = [json.loads(line) for line in (out / "data" / "sequences.jsonl").read_text().splitlines()]
    starts = [chat_length(target, p) for p in read_prompts(out.parent / "train.jsonl")]
    counts = Counter(t for q, st in zip(seqs, starts, strict=True) for t in q[st:])
    assert {t for t, c in counts.items() if c > 1} <= set(vocab.tolist())
    # Greedy output with the head is plain decoding's, on the training prompts and others; on the training
    # prompts, whose answers the head learnt, most drafts are accepted (a head trained one position off
    # gets none).
    prompts = [q[:st] for q, st in zip(seqs, starts, strict=True)]
    prompts += [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 11, [3000 + i for i in range(20)]]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(loaded=target, **KW).generate(prompts, greedy)]
    spec = LLM(loaded=target, speculative_config={"method": "eagle3", "model": str(out),
                                                  "num_speculative_tokens": 2}, **KW)
    outs = spec.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == ref
    learnt = outs[: len(seqs)]
    accepted = sum(o.spec_num_accepted_tokens for o in learnt)
    assert accepted > 0.4 * sum(o.spec_num_draft_tokens for o in learnt)


def test_answer_rows_per_step(trained: Trained) -> None:
    """Row j of step k drafts position j + k + 2: it counts where that position is an answer token."""
    target, out, _ = trained
    head = load_eagle3(str(out), target).head
    ids = list(range(100, 130))
    feats = sequence_features(target, [ids], AUX, [12])
    vocab = [int(t) for t in mx.arange(256) + head.d2t]
    t2d = np.full(target.vocab_size, -1, dtype=np.int32)
    t2d[vocab] = np.arange(256)
    teacher = Teacher(target.model.model.embed_tokens, mx.array(t2d), output_rows(target, vocab), None)
    _, counts = ttt_loss(head, teacher.batch(feats), 3)
    assert [int(c[1]) for c in counts] == [30 - 12] * 3
    _, counts = ttt_loss(head, teacher.batch(sequence_features(target, [ids], AUX, [1])), 3)
    assert [int(c[1]) for c in counts] == [30 - 2, 30 - 3, 30 - 4]


def test_training_lowers_the_loss_raises_top1_and_resumes(trained: Trained) -> None:
    """The tiny target writes unpredictable text, so the trained head's gains show on its training answers;
    held-out figures are measured all the same."""
    target, out, s = trained
    assert (s["sequences"], s["held_out_sequences"], s["steps"]) == (12, 4, STEPS)
    assert 0 < s["draft_vocab_coverage"] < 1
    assert s["final_loss"] < 0.8 * s["initial_loss"]
    for k in ("draft1", "draft2", "draft3"):
        assert s["train_top1"][k] > s["train_top1_untrained"][k] + 0.05, k
        assert 0.0 <= s["held_out_top1"][k] <= 1.0
    ck = out / "checkpoint"
    assert json.loads((ck / "state.json").read_text())["step"] == STEPS
    with pytest.raises(ValueError, match="--resume"):
        train_eagle3(target, out, out / "unused", None, _settings(STEPS + 4), progress=False)
    before = mx.load(str(ck / "model.safetensors"))["fc.weight"]
    mx.eval(before)  # mx.load is lazy: read it before the file is rewritten
    again = train_eagle3(target, out, out.parent / "train.jsonl", None, _settings(STEPS + 4), resume=True,
                         progress=False)
    assert json.loads((ck / "state.json").read_text())["step"] == STEPS + 4
    assert again["sequences"] == 12 and again["train_top1_untrained"] == s["train_top1_untrained"]
    assert not mx.array_equal(before, mx.load(str(ck / "model.safetensors"))["fc.weight"]).item()


def test_init_starts_from_a_trained_head_on_new_data(trained: Trained) -> None:
    """`init`: the head's weights and vocabulary are the trained one's (new data would choose another
    vocabulary), with a fresh schedule: zero steps write the same tensors back."""
    target, out, s = trained
    again = out.parent / "init-head"
    more = _prompts(out.parent / "more.jsonl", 16, 2)
    summary = train_eagle3(target, again, more, None, replace(_settings(0), init=out), progress=False)
    assert summary["sequences"] == 16 and summary["steps"] == 0
    was, now = mx.load(str(out / "model.safetensors")), mx.load(str(again / "model.safetensors"))
    assert set(was) == set(now)
    for name in was:
        assert mx.array_equal(was[name], now[name]).item(), name
    assert json.loads((again / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    assert 0 < summary["draft_vocab_coverage"] < 1  # the trained head's vocabulary, measured on the new data
    with pytest.raises(ValueError, match="aux layers"):
        train_eagle3(target, out.parent / "init-other", more, None,
                     replace(_settings(0), init=out, aux_layer_ids=(1, 3, 5)), progress=False)


def test_narrowed_head_keeps_the_frequent_tokens_and_strongest_neurons(trained: Trained) -> None:
    """A vocabulary cut keeps the most frequent answer tokens and their logits; an MLP cut keeps the
    neurons of largest norm product, whose weights are the trained ones."""
    target, out, _ = trained
    old, vocab = load_head(target, out)
    feats = sequence_features(target, [list(range(100, 140))], AUX, [4])
    counts = Counter(int_list(feats[0]["tokens"][4:]))
    head, cut, config = narrowed_head(target, out, counts, 32, None)
    assert len(cut) == 32 and cut == sorted(cut) and set(cut) <= set(vocab)
    assert {t for t in counts if t in set(vocab)} <= set(cut)  # every answer token the head held
    assert config["draft_vocab_size"] == 32 and head.cfg.draft_vocab_size == 32
    # The kept rows are the target's own (float32, where the saved head holds float16 copies).
    assert mx.array_equal(head.lm_head.weight, output_rows(target, cut)).item()
    rows = mx.array([vocab.index(t) for t in cut])
    np.testing.assert_allclose(np.array(head.lm_head.weight), np.array(old.lm_head.weight[rows]), atol=2e-3)
    narrow, same, config = narrowed_head(target, out, counts, 10**6, 8)
    assert same == vocab and config["transformer_layer_config"]["intermediate_size"] == 8
    g, u, d = old.gate_proj.weight, old.up_proj.weight, old.down_proj.weight
    score = np.array(mx.linalg.norm(g, axis=1) * mx.linalg.norm(u, axis=1) * mx.linalg.norm(d, axis=0))
    keep = np.sort(np.argsort(-score)[:8])
    np.testing.assert_array_equal(np.array(narrow.gate_proj.weight), np.array(g)[keep])
    np.testing.assert_array_equal(np.array(narrow.down_proj.weight), np.array(d)[:, keep])
    np.testing.assert_array_equal(np.array(narrow.fc.weight), np.array(old.fc.weight))


def _serving_aux(core: EngineCore, ids: list[int]) -> mx.array:
    """The aux rows of the engine's model pass for `ids` (as tests/spec/test_eagle3.py's dense_drafts)."""
    runner = core.runner
    meta = build_metadata([(0, len(ids), list(range(-(-len(ids) // runner.kv.block_size))))],
                          runner.kv.block_size)
    for c in runner.caches:
        c.meta = meta
    try:
        return adapter.hidden_states(runner.model, mx.array(ids), runner.caches, aux_layers=AUX)[1]
    finally:
        for c in runner.caches:
            c.meta = None


def _sharp_head(target: LoadedModel, vocab: list[int], folder: Path) -> Path:
    """A fresh head with large random weights, so RoPE positions and every attended key change the logits."""
    config = head_config(target, len(vocab), AUX, 3)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    mx.random.seed(7)
    head = new_head(target, read_config(folder), vocab, init_std=0.3)
    save_head(head, config, vocab, folder, mx.float32)
    return folder


class _Recorder:
    """Stands in for the proposer's head: records the logits of each call."""

    def __init__(self, head: Any) -> None:
        self.head, self.calls = head, []  # type: ignore[var-annotated]

    def __call__(self, *args: Any) -> tuple[mx.array, mx.array]:
        logits, h = self.head(*args)
        self.calls.append(np.array(logits))
        return logits, h

    def __getattr__(self, name: str) -> Any:
        return getattr(self.head, name)


def _record_drafts(core: EngineCore, prompts: list[list[int]]) -> list[tuple[list[int], list[int], list]]:
    """Per proposal, one request at a time: (token ids, drafts, logits of the head's calls: the catch-up
    rows, then one row per further draft)."""
    prop: Any = core.speculation.proposer
    rec = prop.head = _Recorder(prop.head)
    seen: list[tuple[list[int], list[int], list]] = []
    real = prop.propose

    def recording(reqs: list[DraftRequest]) -> list[list[int]]:
        rec.calls = []
        got = real(reqs)
        if got[0]:
            seen.append((list(reqs[0].token_ids), got[0], rec.calls))
        return got

    prop.propose = recording
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        while core.has_unfinished():
            core.step()
    return seen


def test_training_forward_is_the_serving_pass(trained: Trained, tmp_path: Path) -> None:
    """The training features are the engine's aux rows; TTT step 0 gives the serving head's logits for every
    catch-up row over its paged KV, and step k at row n - 2 of the sequence extended by the first k drafts
    gives the logits (and the token) of the proposer's draft k + 1, on a head whose attention matters."""
    target, out, _ = trained
    vocab = load_eagle3(str(out), target)
    folder = _sharp_head(target, [int(t) for t in mx.arange(256) + vocab.head.d2t], tmp_path / "sharp")
    core = EngineCore(EngineConfig(activation_precision="float32", speculative_config={
        "method": "eagle3", "model": str(folder), "num_speculative_tokens": 3,
        "draft_backend": "mlx"}, **KW), loaded=target)  # the MLX module: the C loop is checked against it
    head = core.speculation.proposer.head  # type: ignore[union-attr]
    ids = json.loads((out / "data" / "heldout.jsonl").read_text().splitlines()[0])
    aux = sequence_features(target, [ids], AUX, [1], dtype=mx.float32)[0]["aux"]
    np.testing.assert_allclose(np.array(aux), np.array(_serving_aux(core, ids)), rtol=1e-4, atol=1e-4)
    seen = _record_drafts(core, [ids[:20], [5, 6, 7, 8, 9, 10], [42] * 9])
    assert len(seen) >= 6 and any(len(d) == 3 for _, d, _ in seen)
    for toks, drafts, calls in seen:
        ext, n = toks + drafts[:-1], len(toks)
        f = sequence_features(target, [ext], AUX, [1], dtype=mx.float32)[0]
        steps = ttt_logits(head, target.model.model.embed_tokens(mx.array(ext))[None], f["aux"][None],
                           len(drafts))
        assert len(calls) == len(drafts) and calls[0].shape[0] >= 1
        caught_up = np.array(steps[0][0, n - 1 - calls[0].shape[0]: n - 1])  # rows done .. n - 2
        np.testing.assert_allclose(caught_up, calls[0], rtol=1e-3, atol=1e-3)
        for k in range(1, len(drafts)):
            np.testing.assert_allclose(np.array(steps[k][0, n - 2]), calls[k][0], rtol=1e-3, atol=1e-3)
        assert drafts == [int(head.target_ids(mx.argmax(z[0, n - 2]))) for z in steps]


def test_cli_parses_runs_and_lists_its_flags(tiny: tuple[LoadedModel, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from server.cli import build_parser, main

    parser = build_parser()
    assert settings_from_args(parser.parse_args(["train-eagle3", "--out", "d"])) == Eagle3Settings()
    args = parser.parse_args(["train-eagle3", "--out", "d", "--max-sequences", "0", "--draft-vocab-size",
                              "64", "--ttt-steps", "5", "--lr", "1e-3", "--resume"])
    s = settings_from_args(args)
    assert (s.max_sequences, s.draft_vocab_size, s.ttt_steps, s.lr, args.resume) == (None, 64, 5, 1e-3, True)
    assert s.aux_layer_ids is None
    s = settings_from_args(parser.parse_args(["train-eagle3", "--out", "d", "--aux-layers", "7,2,4"]))
    assert s.aux_layer_ids == (2, 4, 7)
    with pytest.raises(ValueError, match="--aux-layers takes comma-separated layer ids"):
        settings_from_args(parser.parse_args(["train-eagle3", "--out", "d", "--aux-layers", "2;4;7"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["train-eagle3", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--out", "--prompts", "--heldout", "--max-sequences", "--max-new-tokens",
                 "--draft-vocab-size", "--steps", "--batch-size", "--lr", "--ttt-steps", "--seed",
                 "--aux-layers", "--resume"):
        assert flag in text, flag
    _, root = tiny
    out = tmp_path / "cli"
    rc = main(["train-eagle3", "--model", str(root / "tiny-llama"), "--out", str(out), "--prompts",
               str(_prompts(tmp_path / "p.jsonl", 3, 2)), "--heldout", "", "--max-new-tokens", "8",
               "--draft-vocab-size", "64", "--steps", "2", "--batch-size", "2", "--ttt-steps", "2"])
    printed = capsys.readouterr().out
    assert rc == 0 and f"saved the EAGLE-3 head to {out}" in printed and '"method": "eagle3"' in printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 2
    assert json.loads((out / "train_summary.json").read_text())["held_out_sequences"] == 0
