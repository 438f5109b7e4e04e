"""The guide's draft-model pair, Qwen3 target + Qwen3 draft, on tiny random-weight models built with
transformers' own classes and sharing the default model's tokenizer: the target's logits equal
transformers' float32 forward at every position (one prefill, and chunked with batched neighbours),
greedy with the draft equals plain decoding batched, and the draft's KV comes out of --kv-cache-memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cpu import qgemm
from engine.llm import LLM
from engine.models import adapter
from engine.models.loader import load_model
from engine.sampling import SamplingParams
from tests.helpers import CHATS, save_with_default_tokenizer, scale_weights

torch = pytest.importorskip("torch", reason="torch (a test-only dependency: pip install torch==2.13.0) "
                                            "is needed to build the transformers reference models")
transformers = pytest.importorskip("transformers")

VOCAB = 49152  # SmolLM2's tokenizer files


def make_qwen3(folder: Path, seed: int, hidden: int, layers: int, heads: int, kv_heads: int,
          head_dim: int) -> object:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim,
                      max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = Qwen3ForCausalLM(cfg).eval()
    scale_weights(model)
    save_with_default_tokenizer(model, folder)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    root = tmp_path_factory.mktemp("qwen3")
    target = make_qwen3(root / "target", 0, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16)
    make_qwen3(root / "draft", 1, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16)
    return root / "target", root / "draft", target


def _logits(core: EngineCore, chunks: list[tuple[list[int], int, list[int]]]) -> np.ndarray:
    h = core.runner.forward_chunks([(t, s, b, len(t)) for t, s, b in chunks])
    return np.array(adapter.compute_logits(core.runner.model, h))


def test_target_logits_equal_transformers(pair: tuple[Path, Path, object]) -> None:
    tdir, _, reference = pair
    loaded = load_model(str(tdir), dtype="float32", progress=False)
    assert loaded.config["model_type"] == "qwen3"
    core = EngineCore(EngineConfig(kv_cache_memory="64MiB", max_model_len=512, show_progress=False), loaded)
    if qgemm.unsupported_reason() is None:  # qwen3's q/k norms run in the C layers where they can
        assert core.runner.stack is not None
    a, b = (loaded.tokenizer.encode(t) for t in CHATS[:2])
    with torch.no_grad():
        want = reference(torch.tensor([a])).logits[0].numpy()  # type: ignore[operator]
    scale = np.abs(want).max()
    whole = _logits(core, [(a, 0, list(range(0, 8)))])
    assert np.abs(whole - want).max() <= 1e-4 * scale
    # The same prompt in two chunks, the second beside another request's prefill: the same logits.
    split = len(a) // 2
    first = _logits(core, [(a[:split], 0, list(range(8, 16))), (b, 0, list(range(16, 24)))])[:split]
    second = _logits(core, [(a[split:], split, list(range(8, 16)))])
    assert np.abs(np.concatenate([first, second]) - want).max() <= 1e-4 * scale
    # The check can fail: logits one position off are far from the reference.
    assert np.abs(whole[1:] - want[:-1]).max() > 100 * 1e-4 * scale


def test_greedy_with_a_qwen3_draft_equals_plain_decoding(pair: tuple[Path, Path, object]) -> None:
    tdir, ddir, _ = pair
    loaded = load_model(str(tdir), dtype="float32", progress=False)
    kw = dict(kv_cache_memory="64MiB", max_model_len=512, block_size=8, show_progress=False)
    plain = LLM(loaded=loaded, **kw)
    prompts = [loaded.tokenizer.encode(t) for t in CHATS[:4]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, greedy)]
    # The tiny draft (its own weights) and the target drafting for itself (every draft accepted): the
    # rejection and the acceptance paths both run, batched.
    for draft, k in ((ddir, 3), (tdir, 4)):
        spec = LLM(loaded=loaded, speculative_config={"method": "draft_model", "model": str(draft),
                                                      "num_speculative_tokens": k}, **kw)
        outs = spec.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == ref, draft.name
        assert sum(o.spec_num_draft_tokens for o in outs) > 0
        if draft == tdir:
            assert sum(o.spec_num_accepted_tokens for o in outs) == sum(o.spec_num_draft_tokens for o in outs)
        core = spec.core
        assert core.kv.num_free_blocks == core.kv.pool.num_blocks  # every block back, target's and draft's
        proposer = core.speculation.proposer  # type: ignore[union-attr]
        assert proposer.kv.num_free_blocks == proposer.kv.pool.num_blocks > 0
        # The draft's KV comes out of --kv-cache-memory beside the target's, not on top of it.
        assert core.kv_cache.nbytes + proposer.kv_cache.nbytes <= core.config.kv_cache_bytes()
        assert plain.core.kv.pool.num_blocks > core.kv.pool.num_blocks
