"""`specserve train-draft`: distil a draft model for `method: draft_model` from the target's first layers,
final norm and head, against the target's full distribution, as a Hugging Face folder (docs/mtp.md)."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from tqdm import tqdm

from engine.models import adapter
from engine.models.loader import LoadedModel, build_model
from engine.models.weights import flat_arrays
from engine.training.assistant import (
    DEFAULT_PROMPTS,
    Features,
    TrainSettings,
    all_features,
    generate_texts,
    given,
    read_prompts,
    run_cli,
)

logger = logging.getLogger(__name__)


@dataclass
class DraftSettings:
    num_layers: int = 4
    steps: int = 600
    batch_size: int = 4
    lr: float = 3e-4
    save_every: int = 100
    seed: int = 0


def cut_model(target: LoadedModel, num_layers: int) -> tuple[nn.Module, dict]:
    """The target's first `num_layers` layers + final norm + head, as a new mlx-lm model (float32)."""
    n = len(target.model.layers)
    if not 1 <= num_layers < n:
        raise ValueError(f"--num-layers must be between 1 and {n - 1} (the target has {n} layers)")
    config = copy.deepcopy(target.config)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    config["num_hidden_layers"] = num_layers
    keep = {f"model.layers.{i}." for i in range(num_layers)}
    weights = {k: v for k, v in flat_arrays(target.model.parameters())
               if not k.startswith("model.layers.") or any(k.startswith(p) for p in keep)}
    return build_model(config, weights), config


def _loss(draft: nn.Module, tokens: mx.array, teacher_logp: mx.array, mask: mx.array,
          labels: mx.array) -> tuple[mx.array, mx.array]:
    # The whole vocabulary: a loss over a subset leaves the other logits free to rise.
    logits = adapter.compute_logits(draft, draft.model(tokens))  # [B, T, vocab]
    ls = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    n = mx.maximum(mask.sum(), 1.0)
    loss = -((mx.exp(teacher_logp) * ls).sum(-1) * mask).sum() / n
    acc = ((mx.argmax(logits, axis=-1) == labels) * mask).sum() / n
    return loss, acc


def _batch(feats: list[Features], target: LoadedModel) -> tuple[mx.array, ...]:
    """Right-padded tokens [B, T], the target's log-probabilities [B, T, vocab], mask and argmax labels."""
    t = max(int(f["tokens"].shape[0]) for f in feats)
    toks, hid, mask, labels = [], [], [], []
    for f in feats:
        n = int(f["tokens"].shape[0])
        toks.append(mx.pad(f["tokens"], [(0, t - n)]))
        hid.append(mx.pad(f["hidden"].astype(mx.float32), [(0, t - n), (0, 0)]))
        labels.append(mx.pad(f["labels"], [(0, t - n)]))
        mask.append(mx.array([1.0] * n + [0.0] * (t - n)))
    logits = adapter.compute_logits(target.model, mx.stack(hid))
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.stack(toks), logp, mx.stack(mask), mx.stack(labels)


def save_draft(draft: nn.Module, config: dict, target: LoadedModel, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in flat_arrays(draft.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = dict(config, torch_dtype="float16")
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    target.tokenizer.save_pretrained(str(out))


def train_draft(target: LoadedModel, out: Path, prompts_path: Path = DEFAULT_PROMPTS,
                s: DraftSettings | None = None, data: TrainSettings | None = None,
                data_file: Path | None = None, progress: bool = True) -> dict:
    """Generate (or reuse) the self-distilled text, train the cut model (resuming), write `out/`."""
    s = s or DraftSettings()
    data = data or TrainSettings()
    random.seed(s.seed)
    mx.random.seed(s.seed)
    draft, config = cut_model(target, s.num_layers)
    prompts = read_prompts(prompts_path)
    prompts = prompts[: data.max_prompts] if data.max_prompts else prompts
    seqs = generate_texts(target, prompts, data, data_file or out / "data" / "sequences.jsonl")
    layer = len(target.model.layers) - 1
    feats = all_features(target, seqs, layer, progress)
    start_top1 = float(_loss(draft, *_batch(feats[-8:], target))[1])

    ck = out / "checkpoint"
    start = 0
    if (ck / "state.json").exists():
        draft.load_weights(str(ck / "model.safetensors"))
        start = json.loads((ck / "state.json").read_text())["step"]
    draft.freeze()  # embedding and head stay the target's
    for module in [*draft.model.layers, draft.model.norm]:
        module.unfreeze()
    sched = optim.cosine_decay(s.lr, max(1, s.steps), end=s.lr * 0.05)
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)
    loss_grad = nn.value_and_grad(draft, lambda *a: _loss(draft, *a)[0])
    rng = random.Random(s.seed)
    n_epochs = math.ceil(s.steps * s.batch_size / len(feats)) + 1
    flat = [i for _ in range(n_epochs) for i in rng.sample(range(len(feats)), len(feats))]
    losses: list[float] = []
    bar = tqdm(total=s.steps, initial=start, desc="training draft", disable=not progress)
    for step in range(start, s.steps):
        # Resuming restarts the optimiser moments.
        pick = flat[step * s.batch_size: (step + 1) * s.batch_size]
        loss, grads = loss_grad(*_batch([feats[i] for i in pick], target))
        opt.update(draft, grads)
        mx.eval(draft.parameters(), opt.state, loss)
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if (step + 1) % s.save_every == 0 or step + 1 == s.steps:
            ck.mkdir(parents=True, exist_ok=True)
            draft.save_weights(str(ck / "model.safetensors"))
            (ck / "state.json").write_text(json.dumps({"step": step + 1}))
    bar.close()
    _, acc = _loss(draft, *_batch(feats[-8:], target))
    save_draft(draft, config, target, out)
    summary = {"num_layers": s.num_layers, "sequences": len(seqs), "tokens": sum(len(q) for q in seqs),
               "steps": s.steps, "final_loss": losses[-1] if losses else None,
               "start_top1": round(start_top1, 4), "train_top1": round(float(acc), 4)}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main_cli(args: argparse.Namespace) -> int:
    """`specserve train-draft --model M --out DIR` (the namespace comes from server/cli/train.py)."""
    s = DraftSettings(**given(args, "num_layers", "steps", "seed"))
    data = TrainSettings(**given(args, "max_tokens", "seed", "max_prompts"))
    prompts = Path(args.prompts) if args.prompts else DEFAULT_PROMPTS
    data_file = Path(args.data) if args.data else None
    return run_cli("train-draft", args.model,
                   lambda target: train_draft(target, Path(args.out), prompts, s, data, data_file),
                   {"method": "draft_model", "model": args.out, "num_speculative_tokens": 3})
