"""MTP (Gemma4 assistant) speculative decoding: tiny random-weight target + assistant pairs built with
transformers' own classes, loaded by specserve; draft logits match transformers' reference forward,
greedy output with MTP equals without, and each start-up check names its mismatch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.kv.cache import PagedKVCache
from engine.llm import LLM
from engine.models import adapter
from engine.models.loader import load_model
from engine.models.mtp_assistant import MTPAssistantError, load_assistant
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.spec.mtp import MTPProposer
from engine.spec.proposer import DraftRequest
from engine.step import HiddenRow
from tests.helpers import CHATS, hub_repo, run_offline, save_with_default_tokenizer, scale_weights

torch = pytest.importorskip("torch", reason="torch (a test-only dependency: pip install torch==2.13.0) "
                                            "is needed to build the transformers reference models")
transformers = pytest.importorskip("transformers")

VOCAB = 49152  # SmolLM2's tokenizer files
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
COMMON = dict(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
              hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, sliding_window=8,
              final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _patch_config(folder: Path, extra: dict[str, Any], text: bool) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (cfg["text_config"] if text else cfg).update(extra)
    (folder / "config.json").write_text(json.dumps(cfg))


def make_pair(root: Path, seed: int = 0, ordered: bool = False, target_kind: str | None = None,
              **assistant_overrides: Any) -> tuple[Path, Path, Any, Any]:
    """A target and its assistant. `target_kind`: None for a target with one head size and no shared KV,
    or a published structure of tests/engine/test_gemma4.py (mixed head sizes, KV-shared layers,
    per-layer inputs, K = V) with an assistant shaped to read it."""
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4ForCausalLM,
        Gemma4TextConfig,
    )

    tdir = root / "target"
    text = dict(COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=2, layer_types=TYPES[-2:],
                num_kv_shared_layers=2)
    if target_kind is None:
        torch.manual_seed(seed)
        tcfg = Gemma4TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                layer_types=list(TYPES), num_kv_shared_layers=0, **COMMON)
        target = Gemma4ForCausalLM(tcfg).eval()
        scale_weights(target)
        save_with_default_tokenizer(target, tdir)
        global_head_dim = 16
    else:
        from tests.engine.test_gemma4 import GLOBAL_HEAD_DIM, KINDS, make_gemma4

        target = make_gemma4(tdir, target_kind, seed)
        kind = KINDS[target_kind]
        global_head_dim = GLOBAL_HEAD_DIM
        text.update(layer_types=kind["layer_types"][-2:], global_head_dim=global_head_dim,
                    num_key_value_heads=kind["num_key_value_heads"])
        for key in ("attention_k_eq_v", "num_global_key_value_heads"):
            if key in kind:
                text[key] = kind[key]
    text.update(assistant_overrides.pop("text", {}))
    acfg = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**text), backbone_hidden_size=64,
                                 use_ordered_embeddings=ordered, num_centroids=64,
                                 centroid_intermediate_top_k=4, **assistant_overrides)
    # transformers 5.23's kv_sharing_modes raises when every layer is shared (the assistant's case:
    # no layer produces KV); every assistant layer reuses the target's KV, so say exactly that.
    orig = Gemma4TextConfig.kv_sharing_modes

    def all_reuse(self: Any) -> list[str | None]:
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return orig.fget(self)

    Gemma4TextConfig.kv_sharing_modes = property(all_reuse)
    try:
        assistant = Gemma4AssistantForCausalLM(acfg).eval()
    finally:
        Gemma4TextConfig.kv_sharing_modes = orig
    scale_weights(assistant)
    if ordered:
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
    adir = root / "assistant"
    assistant.save_pretrained(adir)  # the config exactly as transformers writes it
    return tdir, adir, target, assistant


def reference_drafts(target: Any, assistant: Any, ids: list[int], k: int) -> list[np.ndarray]:
    """transformers' MTP loop (SinglePositionMultiTokenCandidateGenerator): target KV of ids[:-1], the
    final-norm hidden that produced ids[-1], a constant query position, post_projection fed back."""
    from transformers import DynamicCache

    p = len(ids) - 1
    with torch.no_grad():
        cache = DynamicCache()  # no config: every layer keeps its full-length KV
        out = target.model(input_ids=torch.tensor([ids[:p]]), past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state[:, -1:]
        types = list(target.config.layer_types)
        last = {t: i for i, t in enumerate(types[:len(types) - target.config.num_kv_shared_layers])}
        shared = {t: (cache.layers[i].keys, cache.layers[i].values) for t, i in last.items()}
        tok = torch.tensor([[ids[-1]]])
        logits_out = []
        for _ in range(k):
            emb = target.model.embed_tokens(tok)
            o = assistant(inputs_embeds=torch.cat([emb, hidden], dim=-1), position_ids=torch.tensor([[p]]),
                          attention_mask=torch.ones(1, p, dtype=torch.long), shared_kv_states=shared)
            logits_out.append(o.logits[0, -1].numpy())
            tok = o.logits.argmax(dim=-1)
            hidden = o.last_hidden_state
    return logits_out


@pytest.mark.parametrize("ordered, target_kind", [(False, None), (True, None), (False, "e2b"), (True, "31b")],
                         ids=["tied-head", "centroid-head", "e2b-target", "31b-target-centroid-head"])
def test_draft_logits_match_transformers(tmp_path: Path, ordered: bool, target_kind: str | None) -> None:
    tdir, adir, hf_target, hf_assistant = make_pair(tmp_path, ordered=ordered, target_kind=target_kind)
    loaded = load_model(str(tdir), dtype="float32", progress=False)
    kv = PagedKVCache(adapter.kv_layout(loaded.model).shapes, 16, 8, mx.float32)
    runner = ModelRunner(loaded.model, kv)
    assistant = load_assistant(str(adir), loaded)
    # The last sliding and the last full target layer that store KV.
    layout = adapter.kv_layout(loaded.model)
    assert assistant.target_layers == {None: [2, 3], "e2b": [5, 4], "31b": [4, 5]}[target_kind]
    assert all(layout.sources[i] == i for i in assistant.target_layers)
    prop = MTPProposer(assistant, loaded, kv)
    tok = loaded.tokenizer
    prompts = [tok.encode(CHATS[0])[:21], tok.encode(CHATS[1])[:6]]  # past the window of 8, and inside it
    tables = [[3, 5, 7, 9], [0, 1]]
    reqs = []
    for i, (ids, table) in enumerate(zip(prompts, tables, strict=True)):
        h = runner.forward_chunks([(ids[:-1], 0, table, 1)])
        reqs.append(DraftRequest(f"r{i}", ids, len(ids), 3, table, hidden=HiddenRow(len(ids) - 1, h[0])))
    for batch in ([reqs[0]], [reqs[1]], reqs):
        drafts, logits = prop.draft(batch, keep_logits=True)
        for j, r in enumerate(batch):
            ref = reference_drafts(hf_target, hf_assistant, r.token_ids, 3)
            for step in range(3):
                ours, want = np.array(logits[step][j]), ref[step]
                scale = float(np.abs(want).max())
                # The centroid head fills unscored tokens with (batch min - 1): compare scored tokens,
                # and require the unscored ones below every scored one.
                scored = want > want.min() if ordered else np.ones_like(want, dtype=bool)
                np.testing.assert_allclose(ours[scored], want[scored], rtol=1e-4, atol=1e-4 * scale)
                if ordered:
                    assert 0 < scored.sum() < len(want) and ours[~scored].max() < ours[scored].min()
            assert drafts[j] == [int(np.argmax(x)) for x in ref]
    # draft_min_token_prob: each draft is cut before its first token the assistant gives less than the
    # cut-off (cut-offs between the drafts' own probabilities, so cuts land at every length).
    drafts, logits = prop.draft(reqs, keep_logits=True)
    probs = np.stack([np.array(mx.softmax(lg, axis=-1).max(axis=-1)) for lg in logits], axis=1)  # [N, K]
    edges = sorted(set(probs.ravel().tolist()))
    lengths = set()
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:], strict=False)]
    for cut in mids + [edges[-1] * 1.01]:
        gated = MTPProposer(assistant, loaded, kv, min_token_prob=cut).propose(reqs)
        for j, row in enumerate(probs):
            n = next((i for i, x in enumerate(row) if x < cut), len(row))
            assert gated[j] == drafts[j][:n], (cut, j)
            lengths.add(n)
    assert len(lengths) >= 3, lengths  # the cuts did land at several lengths
    # One cut-off per position (the last repeating): position 0 against the first, later ones the second.
    for first, later in [(mids[0], mids[-1]), (mids[-1], mids[0]), (0.0, mids[len(mids) // 2])]:
        gated = MTPProposer(assistant, loaded, kv, min_token_prob=[first, later]).propose(reqs)
        for j, row in enumerate(probs):
            n = next((i for i, x in enumerate(row) if x < (first if i == 0 else later)), len(row))
            assert gated[j] == drafts[j][:n], (first, later, j)


@pytest.mark.parametrize("k, target_kind", [(1, None), (3, None), (1, "e2b"), (3, "e4b"), (3, "31b")])
def test_greedy_with_mtp_equals_without(tmp_path: Path, k: int, target_kind: str | None) -> None:
    tdir, adir, _, _ = make_pair(tmp_path, seed=1, target_kind=target_kind)
    loaded = load_model(str(tdir), dtype="float32", progress=False)
    kw = dict(kv_cache_memory="64MiB", max_model_len=512, block_size=8, show_progress=False)
    plain = LLM(loaded=loaded, **kw)
    cfg = {"method": "mtp", "model": str(adir), "num_speculative_tokens": k}
    spec = LLM(loaded=loaded, speculative_config=cfg, **kw)
    prompts = [loaded.tokenizer.encode(t) for t in CHATS[:4]]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, greedy)]
    outs = spec.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == ref
    # The random assistant's drafts are rejected, so back-off skips steps (2, then 4, ...); drafting
    # resumes after each skip, which needs the kept hidden row to track plain decode steps too.
    assert all(o.spec_num_draft_tokens >= 4 * k for o in outs), [o.spec_num_draft_tokens for o in outs]
    # With draft_min_token_prob the assistant filters its own drafts, so there is no back-off: a cut-off
    # every token clears drafts on every step (same drafts, more steps with them), output unchanged.
    sure = LLM(loaded=loaded, speculative_config={**cfg, "draft_min_token_prob": 1e-9}, **kw)
    unfiltered = sure.generate(prompts, greedy)
    assert [o.token_ids for o in unfiltered] == ref
    assert sum(o.spec_num_drafts for o in unfiltered) > sum(o.spec_num_drafts for o in outs)
    assert sure.core.kv.num_free_blocks == sure.core.kv.pool.num_blocks
    # Mixed with a sampled request in the same batch: greedy rows still match exactly.
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    mixed = spec.generate(prompts[:2] + prompts[:1], [greedy, greedy, sampled])
    assert [o.token_ids for o in mixed[:2]] == ref[:2]
    assert spec.core.kv.num_free_blocks == spec.core.kv.pool.num_blocks
    assert not spec.core.speculation.hidden  # released with the requests


@pytest.mark.parametrize("override, message", [
    ({"text": {"vocab_size": VOCAB - 8}}, "vocabulary size mismatch"),
    ({"backbone_hidden_size": 48}, "hidden size mismatch"),
    ({"text": {"layer_types": ["full_attention", "full_attention"]}}, "do not match the tail"),
    ({"text": {"enable_moe_block": True, "num_experts": 2, "top_k_experts": 1, "moe_intermediate_size": 16}},
     "MoE"),
    ({"text": {"hidden_size_per_layer_input": 8}}, "per-layer inputs"),
    ({"text": {"num_key_value_heads": 1}}, "architecture mismatch"),
    # A full-attention assistant layer with the sliding head size, against a target whose full layers are
    # wider (the published E2B's 512 against 256).
    ({"target_kind": "e2b", "text": {"global_head_dim": 16}},
     r"assistant layer 1 \(full_attention\) has head_dim 16.*target layer 4 KV it reads has head_dim 32"),
])
def test_startup_checks_name_the_mismatch(tmp_path: Path, override: dict[str, Any], message: str) -> None:
    override = dict(override)
    tdir, adir, _, _ = make_pair(tmp_path, target_kind=override.pop("target_kind", None))
    cfg = json.loads((adir / "config.json").read_text())
    for key, value in override.items():
        if key == "text":
            cfg["text_config"].update(value)
        else:
            cfg[key] = value
    (adir / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(tdir), dtype="float32", progress=False)
    with pytest.raises(MTPAssistantError, match=message):
        load_assistant(str(adir), loaded)
    # The engine refuses at start-up too: no fallback to plain decoding.
    with pytest.raises(ValueError, match=message):
        LLM(loaded=loaded, speculative_config={"method": "mtp", "model": str(adir)}, kv_cache_memory="16MiB",
            max_model_len=256, block_size=8, show_progress=False)


def test_wrong_model_type_and_target(tmp_path: Path) -> None:
    tdir, adir, _, _ = make_pair(tmp_path)
    loaded = load_model(str(tdir), dtype="float32", progress=False)
    cfg = json.loads((adir / "config.json").read_text())
    (adir / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    with pytest.raises(MTPAssistantError, match="model_type 'llama' is not an MTP assistant"):
        load_assistant(str(adir), loaded)
    (adir / "config.json").write_text(json.dumps(dict(cfg, model_type="gemma4_mtp")))
    assert load_assistant(str(adir), loaded).target_layers == [2, 3]  # the alias is accepted
    from engine.models.loader import LoadedModel

    smol_like = LoadedModel(loaded.model, loaded.tokenizer, dict(loaded.config, model_type="llama"), "x", "x",
                            "folder", mx.float32)
    with pytest.raises(MTPAssistantError, match="model_type mismatch"):
        load_assistant(str(adir), smol_like)


@pytest.mark.parametrize("case, message", [
    ("out of range", "token_ordering: token id 49152 is outside the vocabulary [0, 49152)"),
    ("negative", "token_ordering: token id -1 is outside"),
    ("missing", "lack masked_embedding.token_ordering"),
], ids=["out-of-range", "negative", "missing"])
def test_centroid_head_token_ordering_is_checked(tmp_path: Path, case: str, message: str) -> None:
    """The centroid head gathers embedding rows with `token_ordering`: ids outside the vocabulary (an
    unchecked read past the table) or a missing tensor are refused at load."""
    tdir, adir, _, _ = make_pair(tmp_path, ordered=True)
    loaded = load_model(str(tdir), dtype="float32", progress=False)
    weights = dict(mx.load(str(adir / "model.safetensors")))
    order = weights["masked_embedding.token_ordering"]
    if case == "missing":
        del weights["masked_embedding.token_ordering"]
    else:
        weights["masked_embedding.token_ordering"] = mx.concatenate(
            [mx.array([VOCAB if case == "out of range" else -1], dtype=order.dtype), order[1:]])
    mx.save_safetensors(str(adir / "model.safetensors"), weights)
    with pytest.raises(MTPAssistantError, match=message.replace("[", r"\[").replace(")", r"\)")):
        load_assistant(str(adir), loaded)


def test_target_and_assistant_by_hub_id_with_pinned_revisions(tmp_path: Path) -> None:
    """The guide's setup pins target and assistant revisions. Offline, from a local Hub cache: `main` of the
    assistant is a broken upload, the pinned commit is the good one; each loads what it names."""
    tdir, adir, _, _ = make_pair(tmp_path / "src", seed=1)
    broken = tmp_path / "broken"
    shutil.copytree(adir, broken)
    _patch_config(broken, {"vocab_size": VOCAB - 8}, text=True)
    good, bad, tcommit = "a" * 40, "b" * 40, "c" * 40
    cache = tmp_path / "hub"
    hub_repo(cache, "specserve-test/tiny-gemma4", {tcommit: tdir}, {"main": tcommit, "v1": tcommit})
    hub_repo(cache, "specserve-test/tiny-gemma4-assistant", {good: adir, bad: broken}, {"main": bad})
    code = (
        "import sys\n"
        "import engine\n"
        "from engine.llm import LLM\n"
        "from engine.sampling import SamplingParams\n"
        "kw = dict(model='specserve-test/tiny-gemma4', revision='v1', dtype='float32',\n"
        "          kv_cache_memory='64MiB', max_model_len=256, block_size=8, show_progress=False)\n"
        "spec = {'method': 'mtp', 'model': 'specserve-test/tiny-gemma4-assistant',\n"
        "        'num_speculative_tokens': 2}\n"
        "p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)\n"
        "prompts = [[1, 5, 9, 14, 22], [3, 4, 5]]\n"
        "plain = [o.token_ids for o in LLM(**kw).generate(prompts, p)]\n"
        "try:\n"
        "    LLM(**kw, speculative_config=spec)\n"
        "    print('MAIN LOADED')\n"
        "except ValueError as e:\n"
        "    print('MAIN REFUSED', str(e).splitlines()[0])\n"
        f"pinned = LLM(**kw, speculative_config=dict(spec, revision='{good}'))\n"
        "outs = pinned.generate(prompts, p)\n"
        "print(pinned.core.loaded.source, [o.token_ids for o in outs] == plain,\n"
        "      sum(o.spec_num_draft_tokens for o in outs))\n")
    lines = run_offline(code, cache, tmp_path / "home")
    assert lines[-2].startswith("MAIN REFUSED") and "vocabulary size mismatch" in lines[-2], lines
    source, same, drafted = lines[-1].split()
    assert source == "hub" and same == "True" and int(drafted) > 0, lines[-1]


@pytest.mark.parametrize("kind", ["mtp", "draft_model"])
def test_guide_benchmark_form(tmp_path: Path, kind: str) -> None:
    """`specserve bench offline --model T --assistant-model A --batch-size 4 --max-tokens N --ignore-eos`:
    an MTP assistant runs as mtp, any other model as draft_model; the JSON names both models."""
    from server.cli import main

    if kind == "mtp":
        tdir, assistant, _, _ = make_pair(tmp_path / "src", seed=1, target_kind="e2b")  # E2B-shaped target
    else:  # the guide's Qwen3 pair
        from tests.spec.test_qwen3_draft import make_qwen3

        tdir, assistant = tmp_path / "target", tmp_path / "draft"
        make_qwen3(tdir, 0, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16)
        make_qwen3(assistant, 1, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16)
    out = tmp_path / "out"
    rc = main(["bench", "offline", "--model", str(tdir), "--assistant-model", str(assistant),
               "--batch-size", "4", "--max-tokens", "8", "--ignore-eos", "--dtype", "float32",
               "--dataset-name", "chat", "--repeats", "1", "--num-warmups", "0", "--max-model-len", "256",
               "--kv-cache-memory", "64MiB", "--output-dir", str(out)])
    assert rc == 0  # 1: the assistant changed greedy token ids
    off, spec = (json.loads((out / f"{m}.json").read_text()) for m in ("off", "assistant"))
    assert spec["config"]["method"] == kind and spec["config"]["num_speculative_tokens"] == 1
    assert spec["config"]["batch_size"] == 4 and len(spec["prompts"]) == 4
    assert spec["models"]["target"]["path"] == str(tdir)
    assert spec["models"]["draft"]["path"] == str(assistant)
    assert spec["runs"][0]["token_ids"] == off["runs"][0]["token_ids"]
    assert all(len(t) == 8 for t in spec["runs"][0]["token_ids"])
    assert spec["summary"]["spec"]["num_draft_tokens"] > 0


def test_a_gemma4_pair_loaded_on_one_thread_serves_on_another(tmp_path: Path) -> None:
    """The server loads on the main thread and steps on the engine thread: every array the target and the
    assistant hold must be evaluated at load (a lazy one belongs to the loading thread's stream; mlx-lm's
    partial-rotary RoPE keeps its frequencies outside `parameters()`)."""
    import threading

    tdir, adir, _, _ = make_pair(tmp_path, seed=1, target_kind="e2b")
    loaded = load_model(str(tdir), dtype="float32", progress=False)
    spec = {"method": "mtp", "model": str(adir), "num_speculative_tokens": 2}
    llm = LLM(loaded=loaded, speculative_config=spec, kv_cache_memory="64MiB", max_model_len=256,
              block_size=8, show_progress=False)
    prompts = [loaded.tokenizer.encode(t) for t in CHATS[:2]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got: list[Any] = []
    worker = threading.Thread(target=lambda: got.append(llm.generate(prompts, greedy)))
    worker.start()
    worker.join()
    assert got and all(o.error is None and len(o.token_ids) == 8 for o in got[0]), got
    assert sum(o.spec_num_draft_tokens for o in got[0]) > 0
