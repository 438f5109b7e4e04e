"""`specserve train-assistant`: self-distil an MTP assistant for a llama-family target on MLX from text the
target writes itself (docs/mtp.md#training-an-assistant)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, TypedDict

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from engine.cpu.host import int_list
from engine.llm import LLM, chat_prompt_ids
from engine.models import adapter
from engine.models.loader import LoadedModel, load_model
from engine.models.mtp_trained import TRAINED_TYPE, TrainedAssistant, load_trained, save_trained
from engine.models.weights import load_arrays
from engine.sampling import SamplingParams
from engine.spec.mtp import top_token_prob
from specserve_configs import shipped

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = shipped("train_prompts.jsonl")
CALIBRATION_CUTS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)  # draft_min_token_prob values the summary reports


@dataclass
class TrainSettings:
    max_tokens: int = 96  # generated tokens per answer
    max_num_seqs: int = 128  # generation batch
    samples_per_prompt: int = 1  # answers per prompt: the first greedy, the others sampled
    # Only greedy requests draft, so greedy text is what the assistant sees; mix_sampled samples odd prompts.
    mix_sampled: bool = False
    temperature: float = 0.8
    head_size: int = 4096
    # MLP width of the assistant's layer (None: a sixth of the target's): narrower streams less per step.
    intermediate_size: int | None = None
    steps: int = 2000  # held-out top-1 stops improving by here
    batch_size: int = 4
    lr: float = 5e-4
    save_every: int = 50
    seed: int = 0
    max_prompts: int | None = 1536
    holdout: int = 0  # the last N prompts are never trained on (benchmark prompts)
    eval_every: int = 250  # steps between held-out top-1 measurements
    eval_fraction: float = 0.04  # generated sequences held out
    # Train on answer positions only (held-out top-1 always is): opt-in, it did not raise acceptance.
    answer_only: bool = False
    init: Path | None = None  # start from this trained assistant (its head vocabulary), fresh optimizer
    # Linear warm-up steps before the cosine decay (None: 100 with `init`, whose trained weights Adam's
    # first full-rate steps would scramble; 0 for a fresh assistant).
    warmup: int | None = None

    def __post_init__(self) -> None:  # a bad flag fails here, not after the features pass
        check_width(self.intermediate_size)


def check_width(intermediate_size: int | None) -> None:
    """ValueError for an MLP width below 1 (None: the default width)."""
    if intermediate_size is not None and intermediate_size < 1:
        raise ValueError(f"intermediate_size must be >= 1, not {intermediate_size}")


def read_prompts(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            out.append(item["prompt"] if isinstance(item, dict) else str(item))
    return out


def generate_texts(target: LoadedModel, prompts: list[str], s: TrainSettings,
                   data_file: Path | None = None) -> list[list[int]]:
    """Prompt + answer token ids written by the target through the engine, in chunks of 4 x `max_num_seqs`;
    with `data_file` (JSONL) each chunk is appended there and skipped on rerun."""
    done: list[list[int]] = []
    if data_file is not None and data_file.exists():
        done = [json.loads(line) for line in data_file.read_text().splitlines() if line.strip()]
    max_len = min(1024, target.max_position_embeddings or 1024)
    llm = LLM(loaded=target, kv_cache_memory=f"{max(1, s.max_num_seqs // 48)}GiB", max_model_len=max_len,
              show_progress=False, max_num_seqs=s.max_num_seqs, max_num_batched_tokens=1024)
    reqs: list[list[int]] = []
    params: list[SamplingParams] = []
    for i, p in enumerate(prompts):
        chat = llm.apply_chat_template([{"role": "user", "content": p}])
        for j in range(s.samples_per_prompt):
            first = j == 0 and not (s.mix_sampled and i % 2)
            temp = 0.0 if first else s.temperature
            reqs.append(chat)
            params.append(SamplingParams(max_tokens=s.max_tokens, temperature=temp,
                                         seed=s.seed * 1000 + i * 10 + j))
    with tqdm(total=len(reqs), initial=len(done), desc="target writes training text", unit="answer") as bar:
        step = 4 * s.max_num_seqs
        for lo in range(len(done), len(reqs), step):
            chunk = reqs[lo: lo + step]
            outs = llm.generate(chunk, params[lo: lo + step])
            new = [list(c) + list(o.token_ids) for c, o in zip(chunk, outs, strict=True)]
            done.extend(new)
            if data_file is not None:
                data_file.parent.mkdir(parents=True, exist_ok=True)
                with data_file.open("a") as f:
                    f.writelines(json.dumps(q) + "\n" for q in new)
            bar.update(len(new))
    return done


def chat_length(target: LoadedModel, prompt: str) -> int:
    """Tokens of the chat-templated prompt, generation header included: where the answer starts."""
    return len(chat_prompt_ids(target.tokenizer, [{"role": "user", "content": prompt}]))


class Features(TypedDict):
    """One sequence's target features (`target_features`)."""
    tokens: mx.array  # [T]
    hidden: mx.array  # [T, d]
    keys: mx.array  # [Hkv, T, D]
    values: mx.array  # [Hkv, T, D]
    labels: mx.array  # [T]
    start: NotRequired[int]  # the first scored position: set once the arrays are evaluated


def target_features(target: LoadedModel, seqs: list[list[int]], layer: int,
                    starts: list[int] | None = None) -> list[Features]:
    """One plain (non-paged) target pass over a right-padded batch. Per sequence: hidden [T, d] (final
    norm), keys/values [Hkv, T, D] of `layer`, labels [T] (argmax), `start` (first scored position)."""
    from mlx_lm.models.cache import make_prompt_cache  # mlx_lm loads transformers (~2 s)

    model = target.model
    cache = make_prompt_cache(model)
    width = max(len(q) for q in seqs)
    ids = mx.array([q + [0] * (width - len(q)) for q in seqs], dtype=mx.int32)
    h = model.model(ids, cache=cache)  # [B, T, d]
    labels = mx.argmax(adapter.compute_logits(model, h), axis=-1).astype(mx.int32)
    out: list[Features] = []
    for i, q in enumerate(seqs):
        t = len(q)
        out.append({"tokens": ids[i, :t], "hidden": h[i, :t].astype(mx.float16),
                    "keys": cache[layer].keys[i, :, :t].astype(mx.float16),
                    "values": cache[layer].values[i, :, :t].astype(mx.float16), "labels": labels[i, :t]})
    mx.eval(out)
    for i, f in enumerate(out):
        f["start"] = starts[i] if starts is not None else 1
    return out


def all_features(target: LoadedModel, seqs: list[list[int]], layer: int, progress: bool,
                 starts: list[int] | None = None) -> list[Features]:
    """`target_features` over every sequence, in batches of 8 of similar length (little padding)."""
    feats: list[Features] = []
    by_len = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for lo in tqdm(range(0, len(seqs), 8), desc="target features", disable=not progress):
        idx = by_len[lo: lo + 8]
        feats.extend(target_features(target, [seqs[i] for i in idx], layer,
                                     [starts[i] for i in idx] if starts is not None else None))
    return feats


def head_rows(target: LoadedModel, ids: mx.array) -> mx.array:
    """The target's output-head rows for token ids (tied embedding or separate lm_head), float32."""
    head = getattr(target.model, "lm_head", None)
    w = head.weight if head is not None else target.model.model.embed_tokens.weight
    return w[ids].astype(mx.float32)


def strongest_neurons(gate: mx.array, up: mx.array, down: mx.array,
                      n: int) -> tuple[mx.array, mx.array, mx.array]:
    """A SwiGLU MLP's weights cut to the `n` neurons of largest |gate| * |up| * |down| row / column norms,
    in their original order."""
    score = mx.linalg.norm(gate, axis=1) * mx.linalg.norm(up, axis=1) * mx.linalg.norm(down, axis=0)
    keep = mx.sort(mx.argsort(-score.astype(mx.float32))[:n])
    return gate[keep], up[keep], down[:, keep]


def init_from_target(target: LoadedModel, head_ids: list[int], layer: int,
                     intermediate_size: int | None = None) -> TrainedAssistant:
    """The assistant starts as the target's `layer` (MLP cut to the `intermediate_size` neurons of largest
    |gate| * |up| * |down| norms; None: a sixth), final norm and head rows."""
    args = target.model.args
    n_kv, head_dim = adapter.kv_shape(target.model)
    d = args.hidden_size
    src = target.model.model.layers[layer]
    inter = int(args.intermediate_size)
    gate, up, down = src.mlp.gate_proj.weight, src.mlp.up_proj.weight, src.mlp.down_proj.weight
    if intermediate_size is None:
        intermediate_size = max(1, inter // 6)
    check_width(intermediate_size)
    if intermediate_size > inter:
        raise ValueError(f"intermediate_size {intermediate_size} is wider than the target's MLP ({inter})")
    if intermediate_size < inter:
        gate, up, down = strongest_neurons(gate, up, down, intermediate_size)
        inter = intermediate_size
    config = {"model_type": TRAINED_TYPE, "target_model_type": target.config.get("model_type"),
              "target_name": target.name, "target_layer": layer, "vocab_size": target.vocab_size,
              "backbone_hidden_size": d, "hidden_size": d, "num_attention_heads": args.num_attention_heads,
              "num_key_value_heads": n_kv, "head_dim": head_dim, "intermediate_size": inter,
              "rms_norm_eps": args.rms_norm_eps, "rope_theta": float(args.rope_theta),
              "rope_traditional": bool(getattr(args, "rope_traditional", False)), "head_size": len(head_ids)}
    net = TrainedAssistant(config)
    ids = mx.array(head_ids, dtype=mx.int32)
    eye = mx.eye(d, dtype=mx.float32)
    net.update(tree_unflatten([
        ("pre_projection.weight", mx.concatenate([mx.zeros((d, d)), eye], axis=1)),  # pass h through
        ("post_projection.weight", eye),
        ("input_layernorm.weight", src.input_layernorm.weight),
        ("post_attention_layernorm.weight", src.post_attention_layernorm.weight),
        ("self_attn.q_proj.weight", src.self_attn.q_proj.weight),
        ("self_attn.o_proj.weight", src.self_attn.o_proj.weight),
        ("mlp.gate_proj.weight", gate),
        ("mlp.up_proj.weight", up),
        ("mlp.down_proj.weight", down),
        ("norm.weight", target.model.model.norm.weight),
        ("head.weight", head_rows(target, ids)),
    ]))
    net.vocab_ids = ids
    net.set_dtype(mx.float32)  # floating parameters only: vocab_ids stays int32
    mx.eval(net.parameters())
    return net


def _batch(feats: list[Features], embed: nn.Module, index: dict[int, int],
           teacher: mx.array, cap: float | None) -> tuple[mx.array, ...]:
    """Right-padded batch over query positions p = 1..T-1: x [B, L, 2d] = [emb(token p), hidden p-1],
    keys/values [B, Hkv, L, D], the teacher's log-probabilities at p, a mask [B, L] from `start`, the
    argmax labels, and for the second draft emb(token p+1) with the log-probabilities at p+1."""
    t = max(int(f["tokens"].shape[0]) for f in feats) - 1
    cols: list[list[mx.array]] = [[] for _ in range(8)]
    for f in feats:
        n = int(f["tokens"].shape[0]) - 1
        first = max(0, int(f["start"]) - 1)  # query index j holds position p = j + 1
        e = embed(f["tokens"][1:]).astype(mx.float32)  # [n, d]: token at query position p
        x = mx.concatenate([e, f["hidden"][:-1].astype(mx.float32)], axis=-1)  # hidden at p - 1
        rows = [index.get(lab, -1) for lab in int_list(f["labels"][1:])]  # head rows (-1: outside)
        e2 = mx.concatenate([e[1:], mx.zeros((1, e.shape[1]))], axis=0)
        pad = [(0, t - n), (0, 0)]
        cols[0].append(mx.pad(x, pad))
        cols[1].append(mx.pad(f["keys"][:, :-1].astype(mx.float32), [(0, 0)] + pad))
        cols[2].append(mx.pad(f["values"][:, :-1].astype(mx.float32), [(0, 0)] + pad))
        cols[3].append(mx.pad(f["hidden"][1:].astype(mx.float32), pad))  # target hidden at p: teacher
        cols[4].append(mx.array([float(j >= first) for j in range(n)] + [0.0] * (t - n)))
        cols[5].append(mx.array([max(v, 0) for v in rows] + [0] * (t - n), dtype=mx.int32))
        cols[6].append(mx.array([float(v >= 0 and j >= first) for j, v in enumerate(rows)] + [0.0] * (t - n)))
        cols[7].append(mx.pad(e2, pad))
    x, k, v, h, m, y, ym, e2 = (mx.stack(c) for c in cols)
    logits = h @ teacher.T
    if cap:
        logits = mx.tanh(logits / cap) * cap
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # renormalised on the head vocabulary
    logp2 = mx.concatenate([logp[:, 1:], mx.zeros_like(logp[:, :1])], axis=1)  # one position on
    m2 = mx.concatenate([m[:, 1:], mx.zeros_like(m[:, :1])], axis=1)
    return x, k, v, logp, m, y, ym, e2, logp2, m2


def _loss(net: TrainedAssistant, x: mx.array, k: mx.array, v: mx.array, logp: mx.array, m: mx.array,
          y: mx.array, ym: mx.array, e2: mx.array, logp2: mx.array, m2: mx.array,
          w2: float = 0.5) -> tuple[mx.array, mx.array]:
    """Distillation: cross-entropy against the target's distribution on the first draft, plus w2 x the same
    on the second (post_projection fed back); also top-1 agreement with the argmax. Alternatives tried:
    docs/design-notes.md."""

    def soft_ce(student: mx.array, teacher: mx.array, mask: mx.array) -> mx.array:
        ls = student - mx.logsumexp(student, axis=-1, keepdims=True)
        return -((mx.exp(teacher) * ls).sum(-1) * mask).sum() / mx.maximum(mask.sum(), 1.0)

    logits, proj = net.train_logits(x, k, v)
    loss = soft_ce(logits, logp, m)
    acc = ((mx.argmax(logits, axis=-1) == y) * ym).sum() / mx.maximum(ym.sum(), 1.0)
    if w2 > 0:
        logits2, _ = net.train_logits(mx.concatenate([e2, proj], axis=-1), k, v)
        loss = loss + w2 * soft_ce(logits2, logp2, m2)
    return loss, acc


def agreement(net: TrainedAssistant, feats: list[Features], embed: nn.Module,
              index: dict[int, int], teacher: mx.array, cap: float | None,
              cuts: tuple[float, ...] = (0.0,)) -> list[tuple[float, float]]:
    """Per cut-off, over the scored positions of `feats`: the share of first drafts made with
    `draft_min_token_prob` = cut, and their top-1 agreement with the argmax (serving acceptance at 0)."""
    hits, made = [0.0] * len(cuts), [0.0] * len(cuts)
    total = 0.0
    for lo in range(0, len(feats), 8):
        batch = _batch(feats[lo: lo + 8], embed, index, teacher, cap)
        x, k, v, m, y, ym = batch[0], batch[1], batch[2], batch[4], batch[5], batch[6]
        logits, _ = net.train_logits(x, k, v)
        top = top_token_prob(logits)
        right = (mx.argmax(logits, axis=-1) == y) * ym  # labels outside the head vocabulary: misses
        for c, cut in enumerate(cuts):
            drafted = m * (top >= cut)
            hits[c] += float((right * drafted).sum())
            made[c] += float(drafted.sum())
        total += float(m.sum())
    return [((n / total if total else 0.0), (h / n if n else 0.0)) for h, n in zip(hits, made, strict=True)]


def _save_state(out: Path, net: TrainedAssistant, opt: optim.Optimizer, step: int) -> None:
    ck = out / "checkpoint"
    save_trained(net, ck, dtype=mx.float32)
    save_optimizer(ck, opt, {"step": step})


def save_optimizer(ck: Path, opt: optim.Optimizer, state: dict) -> None:
    """The optimizer's arrays into `ck/optimizer.safetensors` and `state` (the step) into `ck/state.json`."""
    arrays = dict(tree_flatten(opt.state))
    mx.save_safetensors(str(ck / "optimizer.safetensors"), {k: v for k, v in arrays.items()
                                                            if isinstance(v, mx.array)})
    (ck / "state.json").write_text(json.dumps(state))


def restore_optimizer(ck: Path, opt: optim.Optimizer, params: dict) -> None:
    """`opt` initialised for `params` with the moments and step `save_optimizer` wrote into `ck`."""
    opt.init(params)
    saved = load_arrays(str(ck / "optimizer.safetensors"))
    mx.eval(saved)  # mx.load is lazy and the file is rewritten at the next checkpoint
    state = dict(tree_flatten(opt.state))
    state.update(saved)
    opt.state = tree_unflatten(list(state.items()))


def _training_features(target: LoadedModel, out: Path, prompts_path: Path, s: TrainSettings, layer: int,
                       progress: bool) -> tuple[list[list[int]], list[Features], list[Features]]:
    """(sequences, held-out features, training features): the target's own text, generated or reused."""
    prompts = read_prompts(prompts_path)
    prompts = prompts[: len(prompts) - s.holdout] if s.holdout else prompts
    prompts = prompts[: s.max_prompts] if s.max_prompts else prompts
    seqs = generate_texts(target, prompts, s, out / "data" / "sequences.jsonl")  # resumes by chunk
    # Sequence i answers prompt i // samples_per_prompt.
    lens = [chat_length(target, p) for p in prompts]
    starts = [min(lens[i // s.samples_per_prompt], len(q) - 1) for i, q in enumerate(seqs)]
    feats = all_features(target, seqs, layer, progress, starts)
    # Every n-th sequence by length is held out: its answers' top-1 picks the checkpoint kept.
    step_n = max(2, round(1 / s.eval_fraction)) if s.eval_fraction > 0 else 0
    held: list[Features] = []
    train: list[Features] = []
    for i, f in enumerate(feats):
        (held if step_n and i % step_n == step_n // 2 else train).append(f)
    train = train if s.answer_only else [{**f, "start": 1} for f in train]  # else score every position
    return seqs, held, train


def _scored_labels(feats: list[Features]) -> Counter[int]:
    """The scored labels (the answers' next tokens) and how often each occurs."""
    return Counter(t for f in feats for t in int_list(f["labels"][max(1, int(f["start"])):]))


def share_covered(counts: Counter[int], ids: list[int]) -> float:
    """The share of the counted tokens that `ids` holds (a reduced vocabulary's coverage)."""
    return sum(counts[t] for t in set(ids)) / max(1, sum(counts.values()))


def _net_and_optimizer(target: LoadedModel, out: Path, head_ids: list[int], layer: int,
                       s: TrainSettings) -> tuple[TrainedAssistant, optim.Optimizer, int]:
    """The assistant and its optimizer, resumed from `out/checkpoint` where one exists (else `s.init`'s
    weights, else the target's layer), and the step."""
    ck = out / "checkpoint"
    start = 0
    if (ck / "state.json").exists():
        net = load_trained(ck, json.loads((ck / "config.json").read_text()), mx.float32)
        start = json.loads((ck / "state.json").read_text())["step"]
    elif s.init is not None:
        net = load_trained(s.init, json.loads((s.init / "config.json").read_text()), mx.float32)
    else:
        net = init_from_target(target, head_ids, layer, s.intermediate_size)
    warm = s.warmup if s.warmup is not None else (100 if s.init is not None else 0)
    opt = optim.AdamW(learning_rate=warmup_cosine(s.lr, s.steps, warm), weight_decay=0.0)
    if start:
        restore_optimizer(ck, opt, net.trainable_parameters())
    return net, opt, start


def warmup_cosine(lr: float, steps: int, warmup: int) -> Callable[[mx.array], mx.array]:
    """The learning rate: linear warm-up over `warmup` steps (at most a tenth of `steps`), then cosine decay
    to 5% of `lr` by `steps`."""
    warm = min(warmup, max(1, steps // 10)) if warmup > 0 else 0
    cosine = optim.cosine_decay(lr, max(1, steps - warm), end=lr * 0.05)
    if not warm:
        return cosine
    return optim.join_schedules([optim.linear_schedule(lr / warm, lr, warm), cosine], [warm])


@dataclass
class _Teacher:
    """What every batch and evaluation reads from the target."""
    embed: nn.Module
    index: dict[int, int]  # token id -> head row
    rows: mx.array  # the target's head rows for the head vocabulary
    cap: float | None  # final logit soft-capping

    def batch(self, feats: list[Features]) -> tuple[mx.array, ...]:
        return _batch(feats, self.embed, self.index, self.rows, self.cap)

    def agreement(self, net: TrainedAssistant, feats: list[Features],
                  cuts: tuple[float, ...] = (0.0,)) -> list[tuple[float, float]]:
        return agreement(net, feats, self.embed, self.index, self.rows, self.cap, cuts)


def epoch_order(n: int, picks: int, seed: int) -> list[int]:
    """Indices 0..n-1 in a fresh seeded shuffle per epoch, enough epochs for `picks` draws (and one more)."""
    rng = random.Random(seed)
    return [i for _ in range(math.ceil(picks / n) + 1) for i in rng.sample(range(n), n)]


def _train_steps(net: TrainedAssistant, opt: optim.Optimizer, start: int, feats: list[Features],
                 held: list[Features], teacher: _Teacher, out: Path, s: TrainSettings,
                 progress: bool) -> tuple[list[float], dict[int, float]]:
    """Train from `start` to `s.steps` (checkpointing), leave `net` at the held-out best step; -> losses and
    held-out top-1 per evaluation."""
    loss_grad = nn.value_and_grad(net, lambda *a: _loss(net, *a)[0])
    flat = epoch_order(len(feats), s.steps * s.batch_size, s.seed)
    losses: list[float] = []
    evals: dict[int, float] = {}
    best: tuple[float, dict[str, mx.array]] | None = None
    bar = tqdm(total=s.steps, initial=start, desc="training assistant", disable=not progress)
    for step in range(start, s.steps):
        pick = flat[step * s.batch_size: (step + 1) * s.batch_size]
        loss, grads = loss_grad(*teacher.batch([feats[i] for i in pick]))
        opt.update(net, grads)
        mx.eval(net.parameters(), opt.state, loss)
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if (step + 1) % s.save_every == 0 or step + 1 == s.steps:
            _save_state(out, net, opt, step + 1)
        if held and ((step + 1) % s.eval_every == 0 or step + 1 == s.steps):
            evals[step + 1] = teacher.agreement(net, held)[0][1]
            bar.write(f"step {step + 1}: held-out answer top-1 {evals[step + 1]:.4f}")
            if best is None or evals[step + 1] > best[0]:
                best = (evals[step + 1], dict(tree_flatten(net.parameters())))  # arrays are immutable
    bar.close()
    if best is not None:
        net.update(tree_unflatten(list(best[1].items())))
    return losses, evals


def train_assistant(target: LoadedModel, out: Path, prompts_path: Path = DEFAULT_PROMPTS,
                    s: TrainSettings | None = None, progress: bool = True) -> dict:
    """Generate (or reuse) the self-distilled data, train (resuming), write `out/` for `method: mtp`."""
    s = s or TrainSettings()
    out.mkdir(parents=True, exist_ok=True)
    random.seed(s.seed)
    mx.random.seed(s.seed)
    layer = len(target.model.layers) - 1
    seqs, held, feats = _training_features(target, out, prompts_path, s, layer, progress)
    labels = _scored_labels(feats)
    head_ids = [t for t, _ in labels.most_common(s.head_size)]
    net, opt, start = _net_and_optimizer(target, out, head_ids, layer, s)
    head_ids = int_list(net.vocab_ids)  # a resumed or --init assistant keeps its own head vocabulary
    coverage = share_covered(labels, head_ids)
    teacher = _Teacher(target.model.model.embed_tokens, {t: i for i, t in enumerate(head_ids)},
                       head_rows(target, mx.array(head_ids, dtype=mx.int32)),
                       getattr(target.model.args, "final_logit_softcapping", None))
    losses, evals = _train_steps(net, opt, start, feats, held, teacher, out, s, progress)
    save_trained(net, out, dtype=mx.float16)
    summary = {"sequences": len(seqs), "held_out_sequences": len(held), "tokens": sum(len(q) for q in seqs),
               "answer_only": s.answer_only,
               "head_size": len(head_ids), "head_coverage": round(coverage, 4), "steps": s.steps,
               "final_loss": losses[-1] if losses else None,
               "held_out_top1": {str(k): round(v, 4) for k, v in evals.items()},  # answer positions
               "kept_step": max(evals, key=lambda k: evals[k]) if evals else s.steps,
               # Per draft_min_token_prob: share of held-out answer positions drafted, and top-1 there.
               "held_out_by_min_token_prob": {str(c): [round(x, 4) for x in r] for c, r in zip(
                   CALIBRATION_CUTS, teacher.agreement(net, held, CALIBRATION_CUTS), strict=True)}
               if held else {},
               # On a slice of the training data: a sanity number.
               "train_top1": round(teacher.agreement(net, feats[-8:])[0][1], 4)}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def given(args: argparse.Namespace, *names: str) -> dict:
    """The numeric flags the user set (the CLI's defaults are None; the dataclasses hold the real ones).
    `--max-prompts 0` means every prompt."""
    out = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if "max_prompts" in out:
        out["max_prompts"] = out["max_prompts"] or None
    return out


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    return TrainSettings(**given(args, "steps", "head_size", "intermediate_size", "max_tokens", "seed",
                                 "max_prompts"),
                         mix_sampled=args.mix_sampled, answer_only=getattr(args, "answer_only", False),
                         init=Path(args.init) if getattr(args, "init", None) else None)


def main_cli(args: argparse.Namespace) -> int:
    """`specserve train-assistant --model M --out DIR` (the namespace comes from server/cli/train.py)."""
    s = settings_from_args(args)
    prompts = Path(args.prompts) if args.prompts else DEFAULT_PROMPTS
    return run_cli("train-assistant", args.model, lambda target: train_assistant(target, Path(args.out),
                                                                                  prompts, s),
                   {"method": "mtp", "model": args.out})


def run_cli(name: str, model: str | None, train: Callable[[LoadedModel], dict], spec: dict) -> int:
    """Shared body of the training subcommands: load the target in float32, train, print the summary and
    the speculative config that serves the result."""
    logging.basicConfig(level=logging.INFO)
    t0 = time.monotonic()
    target = load_model(model, dtype="float32", progress=True)
    try:
        summary = train(target)
    except (OSError, ValueError) as e:
        print(f"specserve {name}: {e}", file=sys.stderr)
        return 1
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(summary))
    print(f"serve it with: specserve serve --speculative-config '{json.dumps(spec)}'")
    return 0
