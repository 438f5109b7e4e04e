"""`specserve train-assistant`: self-distil an MTP assistant for a llama-family target on MLX.

1. The target writes its own training text: the real engine (`engine.llm.LLM`, batched) answers a
   prompt set from `configs/` greedily and with sampling.
2. One non-paged target pass per sequence gives the final-norm hidden states, the cached K/V of the
   layer the assistant reads, and the labels: the target's argmax at every position.
3. The assistant learns, at query position p, the target's next token from [embedding of token p,
   target hidden at p - 1], attending to target K/V at positions < p (what it sees when serving).
Initialisation copies the target's last decoder layer, final norm and head rows, and makes
`pre_projection` pass the hidden state through. Checkpoints every `save_every` steps (resumable).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from engine.models import adapter
from engine.models.loader import LoadedModel
from engine.models.mtp_trained import TRAINED_TYPE, TrainedAssistant, load_trained, save_trained

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "configs" / "train_prompts.jsonl"


@dataclass
class TrainSettings:
    max_tokens: int = 96  # generated tokens per answer
    max_num_seqs: int = 64  # generation batch (bigger batches are cheaper per token on CPU)
    samples_per_prompt: int = 1  # answers per prompt: with 1, even prompts greedy and odd ones sampled
    temperature: float = 0.8
    head_size: int = 4096
    steps: int = 600
    batch_size: int = 4
    lr: float = 5e-4
    save_every: int = 50
    seed: int = 0
    max_prompts: int | None = None
    holdout: int = 0  # the last N prompts are never trained on (benchmark prompts)


def read_prompts(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            out.append(item["prompt"] if isinstance(item, dict) else str(item))
    return out


def generate_texts(target: LoadedModel, prompts: list[str], s: TrainSettings,
                   data_file: Path | None = None) -> list[list[int]]:
    """Prompt + answer token ids, written by the target itself through the real engine, in chunks of
    `max_num_seqs` prompts; with `data_file` (JSONL) each chunk is appended there and skipped on rerun."""
    from tqdm import tqdm

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    done: list[list[int]] = []
    if data_file is not None and data_file.exists():
        done = [json.loads(line) for line in data_file.read_text().splitlines() if line.strip()]
    max_len = min(1024, target.max_position_embeddings or 1024)
    llm = LLM(loaded=target, kv_cache_memory="1GiB", max_model_len=max_len, show_progress=False,
              max_num_seqs=s.max_num_seqs)
    reqs: list[list[int]] = []
    params: list[SamplingParams] = []
    for i, p in enumerate(prompts):
        chat = llm.apply_chat_template([{"role": "user", "content": p}])
        for j in range(s.samples_per_prompt):
            first = j == 0 and (s.samples_per_prompt > 1 or i % 2 == 0)
            temp = 0.0 if first else s.temperature  # greedy and sampled answers
            reqs.append(chat)
            params.append(SamplingParams(max_tokens=s.max_tokens, temperature=temp,
                                         seed=s.seed * 1000 + i * 10 + j))
    with tqdm(total=len(reqs), initial=len(done), desc="target writes training text", unit="answer") as bar:
        for lo in range(len(done), len(reqs), s.max_num_seqs):
            chunk = reqs[lo: lo + s.max_num_seqs]
            outs = llm.generate(chunk, params[lo: lo + s.max_num_seqs])
            new = [list(c) + list(o.token_ids) for c, o in zip(chunk, outs, strict=True)]
            done.extend(new)
            if data_file is not None:
                data_file.parent.mkdir(parents=True, exist_ok=True)
                with data_file.open("a") as f:
                    f.writelines(json.dumps(q) + "\n" for q in new)
            bar.update(len(new))
    return done


def target_features(target: LoadedModel, seq: list[int], layer: int) -> dict[str, mx.array]:
    """One plain (non-paged) target pass: hidden [T, d], keys/values [Hkv, T, D], labels [T]."""
    from mlx_lm.models.cache import make_prompt_cache

    model = target.model
    cache = make_prompt_cache(model)
    ids = mx.array(seq, dtype=mx.int32)
    h = model.model(ids[None], cache=cache)[0]  # [T, d]
    labels = mx.argmax(adapter.compute_logits(model, h), axis=-1).astype(mx.int32)
    t = len(seq)
    k, v = cache[layer].keys[0, :, :t], cache[layer].values[0, :, :t]
    out = {"tokens": ids, "hidden": h.astype(mx.float16), "keys": k.astype(mx.float16),
           "values": v.astype(mx.float16), "labels": labels}
    mx.eval(out)
    return out


def init_from_target(target: LoadedModel, head_ids: list[int], layer: int) -> TrainedAssistant:
    args = target.model.args
    n_kv, head_dim = adapter.kv_shape(target.model)
    d = args.hidden_size
    config = {"model_type": TRAINED_TYPE, "target_model_type": target.config.get("model_type"),
              "target_name": target.name, "target_layer": layer, "vocab_size": target.vocab_size,
              "backbone_hidden_size": d, "hidden_size": d, "num_attention_heads": args.num_attention_heads,
              "num_key_value_heads": n_kv, "head_dim": head_dim, "intermediate_size": args.intermediate_size,
              "rms_norm_eps": args.rms_norm_eps, "rope_theta": float(args.rope_theta),
              "rope_traditional": bool(getattr(args, "rope_traditional", False)), "head_size": len(head_ids)}
    net = TrainedAssistant(config)
    src = target.model.model.layers[layer]
    emb = target.model.model.embed_tokens.weight
    ids = mx.array(head_ids, dtype=mx.int32)
    eye = mx.eye(d, dtype=mx.float32)
    net.update(tree_unflatten([
        ("pre_projection.weight", mx.concatenate([mx.zeros((d, d)), eye], axis=1)),  # pass h through
        ("post_projection.weight", eye),
        ("input_layernorm.weight", src.input_layernorm.weight),
        ("post_attention_layernorm.weight", src.post_attention_layernorm.weight),
        ("self_attn.q_proj.weight", src.self_attn.q_proj.weight),
        ("self_attn.o_proj.weight", src.self_attn.o_proj.weight),
        ("mlp.gate_proj.weight", src.mlp.gate_proj.weight),
        ("mlp.up_proj.weight", src.mlp.up_proj.weight),
        ("mlp.down_proj.weight", src.mlp.down_proj.weight),
        ("norm.weight", target.model.model.norm.weight),
        ("head.weight", emb[ids]),
    ]))
    net.vocab_ids = ids
    net.set_dtype(mx.float32)  # floating parameters only: vocab_ids stays int32
    mx.eval(net.parameters())
    return net


def _batch(feats: list[dict[str, mx.array]], embed: nn.Module, index: dict[int, int]) -> tuple[mx.array, ...]:
    """Right-padded batch over query positions p = 1..T-1: x [B, L, 2d] = [emb(token p), hidden p-1],
    keys/values [B, Hkv, L, D] (positions 0..T-2), labels/mask [B, L] (the target's argmax at p), and for
    the second draft (same query position, as when serving K > 1) emb(token p+1) and labels at p+1."""
    t = max(int(f["tokens"].shape[0]) for f in feats) - 1
    cols: list[list[mx.array]] = [[] for _ in range(8)]
    for f in feats:
        n = int(f["tokens"].shape[0]) - 1
        e = embed(f["tokens"][1:]).astype(mx.float32)  # [n, d]: token at query position p
        x = mx.concatenate([e, f["hidden"][:-1].astype(mx.float32)], axis=-1)  # hidden at p - 1
        y = [index.get(lab, -1) for lab in f["labels"][1:].tolist()]
        y2 = y[1:] + [-1]  # second draft: the label one position on
        e2 = mx.concatenate([e[1:], mx.zeros((1, e.shape[1]))], axis=0)
        pad = [(0, t - n), (0, 0)]
        cols[0].append(mx.pad(x, pad))
        cols[1].append(mx.pad(f["keys"][:, :-1].astype(mx.float32), [(0, 0)] + pad))
        cols[2].append(mx.pad(f["values"][:, :-1].astype(mx.float32), [(0, 0)] + pad))
        for c, labels in ((3, y), (5, y2)):
            cols[c].append(mx.array([max(v, 0) for v in labels] + [0] * (t - n), dtype=mx.int32))
            cols[c + 1].append(mx.array([float(v >= 0) for v in labels] + [0.0] * (t - n)))
        cols[7].append(mx.pad(e2, pad))
    return tuple(mx.stack(c) for c in cols)


def _loss(net: TrainedAssistant, x: mx.array, k: mx.array, v: mx.array, y: mx.array, m: mx.array,
          y2: mx.array, m2: mx.array, e2: mx.array, w2: float = 0.5) -> tuple[mx.array, mx.array]:
    """Cross-entropy on the first draft + w2 x on the second (post_projection fed back)."""
    logits, proj = net.train_logits(x, k, v)
    n = mx.maximum(m.sum(), 1.0)
    loss = (nn.losses.cross_entropy(logits, y, reduction="none") * m).sum() / n
    acc = ((mx.argmax(logits, axis=-1) == y) * m).sum() / n
    if w2 > 0:
        logits2, _ = net.train_logits(mx.concatenate([e2, proj], axis=-1), k, v)
        ce2 = nn.losses.cross_entropy(logits2, y2, reduction="none")
        loss = loss + w2 * (ce2 * m2).sum() / mx.maximum(m2.sum(), 1.0)
    return loss, acc


def _save_state(out: Path, net: TrainedAssistant, opt: optim.Optimizer, step: int) -> None:
    ck = out / "checkpoint"
    save_trained(net, ck, dtype=mx.float32)
    state = dict(tree_flatten(opt.state))
    mx.save_safetensors(str(ck / "optimizer.safetensors"), {k: v for k, v in state.items()
                                                            if isinstance(v, mx.array)})
    (ck / "state.json").write_text(json.dumps({"step": step}))


def train_assistant(target: LoadedModel, out: Path, prompts_path: Path = DEFAULT_PROMPTS,
                    s: TrainSettings | None = None, progress: bool = True) -> dict:
    """Generate (or reuse) the self-distilled data, train (resuming), write `out/` for `method: mtp`."""
    from tqdm import tqdm

    s = s or TrainSettings()
    out.mkdir(parents=True, exist_ok=True)
    random.seed(s.seed)
    mx.random.seed(s.seed)
    layer = len(target.model.layers) - 1
    prompts = read_prompts(prompts_path)
    prompts = prompts[: len(prompts) - s.holdout] if s.holdout else prompts
    prompts = prompts[: s.max_prompts] if s.max_prompts else prompts
    seqs = generate_texts(target, prompts, s, out / "data" / "sequences.jsonl")  # resumes by chunk
    feats = [target_features(target, q, layer)
             for q in tqdm(seqs, desc="target features", disable=not progress)]
    counts = Counter(t for f in feats for t in f["labels"].tolist())
    head_ids = [t for t, _ in counts.most_common(s.head_size)]
    coverage = sum(counts[t] for t in head_ids) / max(1, sum(counts.values()))

    ck = out / "checkpoint"
    start = 0
    if (ck / "state.json").exists():
        net = load_trained(ck, json.loads((ck / "config.json").read_text()), mx.float32)
        start = json.loads((ck / "state.json").read_text())["step"]
        head_ids = net.vocab_ids.tolist()
    else:
        net = init_from_target(target, head_ids, layer)
    index = {t: i for i, t in enumerate(head_ids)}
    sched = optim.cosine_decay(s.lr, max(1, s.steps), end=s.lr * 0.05)
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)
    if start:
        opt.init(net.trainable_parameters())
        saved = mx.load(str(ck / "optimizer.safetensors"))
        mx.eval(saved)  # mx.load is lazy and the file is rewritten at the next checkpoint
        state = dict(tree_flatten(opt.state))
        state.update(saved)
        opt.state = tree_unflatten(list(state.items()))
    embed = target.model.model.embed_tokens
    loss_grad = nn.value_and_grad(net, lambda *a: _loss(net, *a)[0])
    order = list(range(len(feats)))
    rng = random.Random(s.seed)
    n_epochs = math.ceil(s.steps * s.batch_size / len(order)) + 1
    epochs = [rng.sample(order, len(order)) for _ in range(n_epochs)]
    flat = [i for e in epochs for i in e]
    losses: list[float] = []
    bar = tqdm(total=s.steps, initial=start, desc="training assistant", disable=not progress)
    for step in range(start, s.steps):
        pick = flat[step * s.batch_size: (step + 1) * s.batch_size]
        batch = _batch([feats[i] for i in pick], embed, index)
        loss, grads = loss_grad(*batch)
        opt.update(net, grads)
        mx.eval(net.parameters(), opt.state, loss)
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if (step + 1) % s.save_every == 0 or step + 1 == s.steps:
            _save_state(out, net, opt, step + 1)
    bar.close()
    # Top-1 agreement with the target on (a slice of) the training data: a sanity number, not held out.
    _, acc = _loss(net, *_batch(feats[: min(8, len(feats))], embed, index))
    save_trained(net, out, dtype=mx.float16)
    summary = {"sequences": len(seqs), "tokens": sum(len(q) for q in seqs), "head_size": len(head_ids),
               "head_coverage": round(coverage, 4), "steps": s.steps,
               "final_loss": losses[-1] if losses else None,
               "train_top1": round(acc.item(), 4)}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main_cli(args: argparse.Namespace) -> int:
    """`specserve train-assistant --model M --out DIR` (the namespace comes from server/cli.py)."""
    import sys
    import time

    from engine.models.loader import load_model

    logging.basicConfig(level=logging.INFO)
    t0 = time.monotonic()
    target = load_model(args.model, dtype="float32", progress=True)
    s = TrainSettings(steps=args.steps, head_size=args.head_size, max_tokens=args.max_tokens, seed=args.seed)
    prompts = Path(args.prompts) if args.prompts else DEFAULT_PROMPTS
    try:
        summary = train_assistant(target, Path(args.out), prompts, s)
    except (OSError, ValueError) as e:
        print(f"specserve train-assistant: {e}", file=sys.stderr)
        return 1
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(summary))
    spec = json.dumps({"method": "mtp", "model": args.out})
    print(f"serve it with: specserve serve --speculative-config '{spec}'")
    return 0
