"""EAGLE-3 heads (`method: eagle3`) on the default model: both checkpoint layouts load and run, broken heads
are refused by name, the proposer's incremental drafts equal a dense reference pass, and output with
eagle3 is plain decoding's (greedy alone and batched, seeded sampling), with every KV block returned."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.attention.types import build_metadata
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cpu.build import kernel_reason
from engine.models import adapter
from engine.models.eagle3 import Eagle3Error, load_eagle3, read_config
from engine.sampling import SamplingParams
from engine.spec.config import SpeculativeConfigError, parse_speculative_config
from engine.spec.proposer import DraftRequest
from tests.helpers import CHATS, chat_prompts, default_model, make_llm

AUX = [2, 15, 27]
REPEAT = "0000000000000000000000"  # the default model goes on repeating one token
KW = {"max_model_len": 512, "kv_cache_memory": "256MiB"}


def write_head(folder: Path, layout: str = "speculators", draft_vocab: int | None = None, seed: int = 0,
               lens: bool = False, drop: str | None = None, reshape: str | None = None) -> Path:
    """A head for the default model in `layout` ("speculators" or "eagle"): random weights, or with `lens`
    one that reads the last aux layer through the target's own norm and embeddings (a logit lens: it
    drafts the newest token again, accepted where the output repeats one token). `drop`/`reshape` break
    one tensor."""
    target = default_model()
    t = target.config
    h, heads, kv_heads = int(t["hidden_size"]), int(t["num_attention_heads"]), int(t["num_key_value_heads"])
    hd, inter, vocab = h // heads, int(t["intermediate_size"]), target.vocab_size
    vd = draft_vocab or vocab
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> mx.array:  # large enough that the token, its position and the KV all matter
        return mx.array(rng.normal(0, 1.0 / np.sqrt(shape[-1]), shape).astype(np.float32))

    p = "layers.0." if layout == "speculators" else "midlayer."
    w = {"fc.weight": rand(h, 3 * h), f"{p}self_attn.q_proj.weight": rand(heads * hd, 2 * h),
         f"{p}self_attn.k_proj.weight": rand(kv_heads * hd, 2 * h),
         f"{p}self_attn.v_proj.weight": rand(kv_heads * hd, 2 * h),
         f"{p}self_attn.o_proj.weight": rand(h, heads * hd),
         f"{p}mlp.gate_proj.weight": rand(inter, h), f"{p}mlp.up_proj.weight": rand(inter, h),
         f"{p}mlp.down_proj.weight": rand(h, inter), f"{p}input_layernorm.weight": mx.ones(h),
         f"{p}hidden_norm.weight": mx.ones(h), f"{p}post_attention_layernorm.weight": mx.ones(h),
         "norm.weight": mx.ones(h), "lm_head.weight": rand(vd, h)}
    if lens:
        w["fc.weight"] = mx.concatenate([mx.zeros((h, 2 * h)), mx.eye(h)], axis=1)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            w[f"{p}{name}.weight"] = mx.zeros_like(w[f"{p}{name}.weight"])
        w["norm.weight"] = target.model.model.norm.weight.astype(mx.float32)
        w["lm_head.weight"] = target.model.model.embed_tokens(mx.arange(vocab)).astype(mx.float32)
    if vd != vocab:
        chosen = np.sort(rng.choice(vocab, vd, replace=False))
        w["d2t"] = mx.array((chosen - np.arange(vd)).astype(np.int64))
    if drop:
        del w[drop]
    if reshape:
        w[reshape] = w[reshape][:-1]
    layer = {"model_type": "llama", "hidden_size": h, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads,
             "intermediate_size": inter, "rms_norm_eps": t.get("rms_norm_eps", 1e-5),
             "rope_theta": t.get("rope_theta", 10000.0), "vocab_size": vocab, "num_hidden_layers": 1,
             "max_position_embeddings": 8192}
    if layout == "speculators":
        cfg: dict[str, Any] = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                               "transformer_layer_config": layer, "draft_vocab_size": vd,
                               "norm_before_residual": not lens, "eagle_aux_hidden_state_layer_ids": AUX,
                               "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                                   {"proposal_type": "greedy", "speculative_tokens": 3}]}}
    else:
        cfg = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": vd}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    # float16 values, as heads ship: the C loop's float16 copies are then the weights the MLX module runs.
    w = {k: v if k == "d2t" else v.astype(mx.float16).astype(mx.float32) for k, v in w.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    return folder


@functools.cache
def head_dir(kind: str) -> Path:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix=f"eagle3-{kind}-"))
    return {"random": lambda: write_head(root, "speculators", draft_vocab=512, seed=1),
            "original": lambda: write_head(root, "eagle", draft_vocab=512, seed=2),
            "lens": lambda: write_head(root, "speculators", lens=True)}[kind]()


def spec(kind: str, k: int = 3, backend: str = "auto") -> dict[str, Any]:
    return {"method": "eagle3", "model": str(head_dir(kind)), "num_speculative_tokens": k,
            "draft_backend": backend}


@functools.cache
def llm(kind: str | None) -> Any:
    return make_llm(speculative_config=spec(kind) if kind else None, **KW)


def test_both_layouts_load_with_their_shapes_and_aux_layers(tmp_path: Path) -> None:
    for layout in ("speculators", "eagle"):
        folder = write_head(tmp_path / layout, layout, draft_vocab=512)
        cfg = read_config(folder)
        assert cfg.layout == layout and cfg.draft_vocab_size == 512 and cfg.hidden_size == 576
        loaded = load_eagle3(str(folder), default_model())
        assert loaded.aux_layer_ids == (2, 15, 27)  # the checkpoint's, or the same default for 30 layers
        assert loaded.head.d2t is not None and loaded.head.d2t.shape == (512,)
    override = load_eagle3(str(tmp_path / "eagle"), default_model(), aux_layer_ids=[27, 3, 10])
    assert override.aux_layer_ids == (3, 10, 27)


@pytest.mark.parametrize("drop, reshape, match", [
    ("layers.0.self_attn.k_proj.weight", None, "tensor layers.0.self_attn.k_proj.weight is missing"),
    (None, "fc.weight", r"tensor fc.weight has shape \(575, 1728\), expected \(576, 1728\)"),
    ("d2t", None, "tensor d2t is missing"),
])
def test_a_broken_head_is_refused_naming_the_tensor(tmp_path: Path, drop: str | None, reshape: str | None,
                                                    match: str) -> None:
    folder = write_head(tmp_path / "h", draft_vocab=512, drop=drop, reshape=reshape)
    with pytest.raises(Eagle3Error, match=match):
        load_eagle3(str(folder), default_model())


def test_unsupported_heads_and_keys_are_refused(tmp_path: Path) -> None:
    folder = write_head(tmp_path / "h")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(Eagle3Error, match="PyTorch pickle"):
        load_eagle3(str(folder), default_model())
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "norm_before_fc": True}))
    with pytest.raises(Eagle3Error, match="norm_before_fc"):
        read_config(folder)
    with pytest.raises(SpeculativeConfigError, match="EAGLE-1"):
        parse_speculative_config({"method": "eagle", "model": "x"})
    with pytest.raises(SpeculativeConfigError, match="eagle_aux_hidden_state_layer_ids"):
        parse_speculative_config({"method": "eagle3", "model": "x", "eagle_aux_hidden_state_layer_ids": [1]})
    with pytest.raises(ValueError, match="outside the target's 30 layers"):
        load_eagle3(str(write_head(tmp_path / "g")), default_model(), aux_layer_ids=[2, 15, 30])


def dense_drafts(core: EngineCore, ids: list[int], k: int) -> list[int]:
    """The head run densely (causal attention over every row, no paged KV) on the features the target's
    MLX modules give for `ids`: row j pairs token j + 1 with position j's features."""
    runner, head = core.runner, core.speculation.proposer.head  # type: ignore[union-attr]
    kv, table = runner.kv, list(range(-(-len(ids) // runner.kv.block_size)))
    meta = build_metadata([(0, len(ids), table)], kv.block_size)
    for c in runner.caches:
        c.meta = meta
    try:
        _, feats = adapter.hidden_states(runner.model, mx.array(ids), runner.caches, aux_layers=tuple(AUX))
    finally:
        for c in runner.caches:
            c.meta = None
    cfg = head.cfg
    toks, g = list(ids[1:]), head.fuse(feats[: len(ids) - 1])
    drafts: list[int] = []
    for _ in range(k):
        n = len(toks)
        e = head.input_layernorm(head.embed(mx.array(toks)))
        x = mx.concatenate([e, head.hidden_norm(g)], axis=-1)
        pos = mx.arange(n)
        q = head.rope(head.q_proj(x).reshape(n, cfg.num_heads, 1, cfg.head_dim), offset=pos)[:, :, 0]
        kk = head.rope(head.k_proj(x).reshape(n, cfg.num_kv_heads, 1, cfg.head_dim), offset=pos)[:, :, 0]
        vv = head.v_proj(x).reshape(n, cfg.num_kv_heads, cfg.head_dim)
        rep = cfg.num_heads // cfg.num_kv_heads
        kk, vv = mx.repeat(kk, rep, axis=1), mx.repeat(vv, rep, axis=1)
        scores = mx.einsum("thd,shd->hts", q, kk) * head.scale
        scores = mx.where(mx.tril(mx.ones((n, n), dtype=mx.bool_)), scores, -mx.inf)
        att = mx.einsum("hts,shd->thd", mx.softmax(scores, axis=-1), vv).reshape(n, -1)
        h1 = (head.hidden_norm(g) if cfg.norm_before_residual else g) + head.o_proj(att)
        y = head.post_attention_layernorm(h1)
        h2 = h1 + head.down_proj(mx.sigmoid(head.gate_proj(y)) * head.gate_proj(y) * head.up_proj(y))
        tok = int(head.target_ids(mx.argmax(head.lm_head(head.norm(h2[-1:])), axis=-1))[0])
        drafts.append(tok)
        toks, g = [*toks, tok], mx.concatenate([g, h2[-1:]], axis=0)
    return drafts


@pytest.mark.skipif(kernel_reason() is not None, reason=f"no C kernels here: {kernel_reason()}")
@pytest.mark.parametrize("kind", ["random", "original"])
def test_the_c_loop_drafts_what_the_mlx_modules_draft(kind: str) -> None:
    """Requests wanting different numbers of drafts in one call, over two steps (the second continues each
    request's KV with new catch-up rows): the C loop and the MLX modules draft the same tokens."""
    from engine.spec.eagle3 import Eagle3Proposer
    from engine.step import FeatureRows

    loaded = load_eagle3(str(head_dir(kind)), default_model())
    c, ref = (Eagle3Proposer(loaded, 16, 16, use_c=use_c) for use_c in (True, False))
    assert c.cpu is not None and ref.cpu is None
    rng = np.random.default_rng(0)
    width = 3 * loaded.config.target_hidden_size
    ids = {f"r{i}": [int(t) for t in rng.integers(0, 49152, n)] for i, n in enumerate((5, 40, 17))}
    tables = {rid: [3 + 4 * i, 1 + 4 * i, 2 + 4 * i, 4 * i] for i, rid in enumerate(ids)}
    for step, wants in enumerate(((1, 3, 0), (3, 0, 2))):  # 0: catch-up rows only
        reqs = []
        for (rid, toks), want in zip(ids.items(), wants, strict=True):
            start = 0 if step == 0 else len(toks) - 1 - step * 2
            if step:
                toks.extend(int(t) for t in rng.integers(0, 49152, 2 + step))
            feats = mx.array(rng.normal(0, 1, (len(toks) - 1 - start, width)).astype(np.float32))
            reqs.append(DraftRequest(rid, toks, 3, want, tables[rid], features=[FeatureRows(start, feats)]))
        got, want_drafts = c.propose(reqs), ref.propose(reqs)
        assert [len(d) for d in got] == list(wants)
        assert got == want_drafts, step


@pytest.mark.parametrize(("kind", "backend"), [("random", "auto"), ("original", "auto"), ("lens", "auto"),
                                               ("random", "mlx"), ("lens", "mlx")])
def test_incremental_drafts_equal_a_dense_pass(kind: str, backend: str) -> None:
    """Drafts after a prefill and after decode steps (partly accepted or not) equal the head run densely
    over the whole sequence: the catch-up rows, positions and KV slots line up, in the C loop (auto, where
    kernels build) and in the MLX modules."""
    core = EngineCore(EngineConfig(speculative_config=spec(kind, k=3, backend=backend), show_progress=False,
                                   **KW), loaded=default_model())
    prop = core.speculation.proposer  # type: ignore[union-attr]
    assert (prop.cpu is not None) == (backend == "auto" and kernel_reason() is None), prop.cpu_reason
    prompt = chat_prompts(llm(None), [CHATS[0]])[0]
    core.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0))
    core.add_request("repeat", core.tokenizer.encode(REPEAT), SamplingParams(max_tokens=12, temperature=0.0))
    seen: list[tuple[list[int], list[int]]] = []
    real = prop.propose

    def recording(reqs: list[DraftRequest]) -> list[list[int]]:
        out = real(reqs)
        seen.extend((list(r.token_ids), d) for r, d in zip(reqs, out, strict=True))
        return out

    prop.propose = recording  # type: ignore[method-assign]
    accepted = 0
    while core.has_unfinished():
        outs, _ = core.step()
        accepted += sum(o.spec_num_accepted_tokens for o in outs if o.finished)
    assert len(seen) >= 6
    for ids, drafts in seen[:8]:
        assert drafts == dense_drafts(core, ids, len(drafts)), len(ids)
    assert accepted > 0 or kind != "lens"  # the lens drafts past accepted drafts too


@pytest.mark.parametrize("kind", ["random", "lens"])
def test_greedy_output_is_plain_decoding_alone_and_batched(kind: str) -> None:
    plain, eagle = llm(None), llm(kind)
    prompts = [*chat_prompts(plain, CHATS[:6]), plain.core.tokenizer.encode(REPEAT),
               plain.core.tokenizer.encode("- - - - - - - - - - - -")]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    batched = eagle.generate(prompts, params)
    assert [o.token_ids for o in batched] == ref
    assert [o.token_ids for o in eagle.generate(prompts[:1], params)] == ref[:1]
    drafted = sum(o.spec_num_draft_tokens for o in batched)
    accepted = sum(o.spec_num_accepted_tokens for o in batched)
    assert drafted > 0
    if kind == "lens":
        assert accepted > 0, "the logit-lens head should get some drafts accepted"
    core = eagle.core
    assert not core.has_unfinished() and core.kv.num_free_blocks == core.kv.pool.num_blocks
    prop = core.speculation.proposer
    assert not prop._done and not prop._pending and not core.speculation.features  # type: ignore[attr-defined]


def test_seeded_sampling_is_plain_seeded_sampling() -> None:
    plain, eagle = llm(None), llm("lens")
    prompts = chat_prompts(plain, CHATS[:3])
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=5 + i) for i in range(3)]
    assert [o.token_ids for o in eagle.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]


@pytest.mark.parametrize("backend", ["auto", "mlx"])
def test_a_prefix_cache_hit_drafts_from_the_cached_blocks_head_kv(backend: str) -> None:
    """The head's KV sits at the target's block ids, so a request whose prompt is a cache hit reads the
    head's rows from the cached blocks: its drafts equal the dense pass over the whole sequence."""
    core = EngineCore(EngineConfig(speculative_config=spec("random", k=3, backend=backend),
                                   show_progress=False, **KW), loaded=default_model())
    assert core.kv.enable_prefix_caching
    prompt = chat_prompts(llm(None), [CHATS[1]])[0]
    prop = core.speculation.proposer  # type: ignore[union-attr]
    seen: list[tuple[list[int], list[int]]] = []
    real = prop.propose

    def recording(reqs: list[DraftRequest]) -> list[list[int]]:
        out = real(reqs)
        seen.extend((list(r.token_ids), d) for r, d in zip(reqs, out, strict=True)
                    if r.request_id == "second")
        return out

    prop.propose = recording  # type: ignore[method-assign]
    for rid in ("first", "second"):
        core.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0))
        while core.has_unfinished():
            core.step()
    assert core.scheduler.requests == {} and core.kv.num_free_blocks == core.kv.pool.num_blocks
    assert core.kv.prefix_hits > 0
    assert seen and all(d == dense_drafts(core, ids, len(d)) for ids, d in seen if d)


def test_a_prompts_catch_up_runs_before_the_timed_draft_call() -> None:
    """The first draft after a prefill: the prompt's rows go to the head in a call of their own (num_drafts
    0) before the draft call, which carries only the newest row, so adaptive K's measured draft cost holds
    what drafting adds (a prompt's catch-up once made eagle3 "auto" look too slow ever to draft)."""
    core = EngineCore(EngineConfig(speculative_config=spec("random", k=2), show_progress=False, **KW),
                      loaded=default_model())
    prop = core.speculation.proposer  # type: ignore[union-attr]
    calls: list[list[tuple[int, int]]] = []  # per call: (num_drafts, feature rows) of each request
    real = prop.propose

    def recording(reqs: list[DraftRequest]) -> list[list[int]]:
        calls.append([(r.num_drafts, sum(int(f.rows.shape[0]) for f in r.features)) for r in reqs])
        return real(reqs)

    prop.propose = recording  # type: ignore[method-assign]
    prompt = chat_prompts(llm(None), [CHATS[2]])[0]
    core.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    while core.has_unfinished():
        core.step()
    assert calls[:2] == [[(0, len(prompt) - 1)], [(2, 1)]], calls  # the prompt's rows, then the newest

