"""`specserve train-eagle3`: train an EAGLE-3 draft head for a target on MLX from text the target writes
itself, saved in the speculators layout that `method: eagle3` (and vLLM) load (docs/speculative-decoding.md).

What is trained: `fc` (the 3 aux features -> hidden), the decoder layer (its projections, MLP and the
three norms) and the final `norm` (initialised to the target's final norm). Frozen: the embeddings (the
target's, called but never saved) and `lm_head`, the target's output rows for the draft vocabulary, as
speculators keeps it: the head then only has to put its state where the target's own head reads it.

Loss: soft cross-entropy (forward KL up to the target's entropy) of the head's draft-vocabulary
log-softmax against the target's softmax restricted to the draft vocabulary, on answer tokens whose
target argmax is in the draft vocabulary, averaged over the training-time-test (TTT) steps with equal
weights. TTT step 0 is the serving catch-up pass (row j: token j + 1, the target's features at position j,
RoPE position j); step k > 0 feeds the head's own output of step k - 1 back at the same row with the
ground-truth token k positions further, and attends to step 0's keys of rows <= j plus its own chain's
keys of steps 1..k, which is what the paged KV holds when serving drafts token k + 1.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from engine.cpu.host import int_list
from engine.models import adapter
from engine.models.eagle3 import (
    SPECULATORS_TYPE,
    Eagle3Config,
    Eagle3Head,
    default_aux_layers,
    parse_config,
    read_config,
)
from engine.models.loader import LoadedModel
from engine.models.weights import load_arrays
from engine.training.assistant import (
    DEFAULT_PROMPTS,
    TrainSettings,
    chat_length,
    check_width,
    epoch_order,
    generate_texts,
    given,
    read_prompts,
    restore_optimizer,
    run_cli,
    save_optimizer,
    share_covered,
    strongest_neurons,
    warmup_cosine,
)
from specserve_configs import shipped

DEFAULT_HELDOUT = shipped("train_prompts_heldout.jsonl")
EVAL_STEPS = 3  # held-out top-1 is reported for the first draft and TTT steps 2 and 3


@dataclass
class Eagle3Settings:
    max_sequences: int | None = 1536  # training prompts used, one greedy answer each (None: all)
    max_new_tokens: int = 96  # tokens the target writes per answer
    draft_vocab_size: int = 8192
    ttt_steps: int = 3  # speculators' default; weights equal
    steps: int = 3000
    batch_size: int = 4  # sequences per step
    lr: float = 5e-4  # train-assistant's, for a head of similar size on the same data
    warmup: int = 100  # linear warm-up steps, then cosine decay to 5%
    init_std: float = 0.02  # fresh fc and layer weights: normal(0, init_std), as Hugging Face initialises
    seed: int = 0
    save_every: int = 100
    eval_every: int = 500
    max_num_seqs: int = 128  # generation batch
    aux_layer_ids: tuple[int, ...] | None = None  # None: (2, L // 2, L - 3)
    intermediate_size: int | None = None  # the head's MLP width (None: the target's; with init: the init's)
    init: Path | None = None  # start from this trained head (its vocabulary and aux layers), fresh optimizer

    def __post_init__(self) -> None:  # a bad flag fails here, not after the features pass
        check_width(self.intermediate_size)
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:  # EAGLE-3: low, middle, high
            raise ValueError(f"an EAGLE-3 head reads 3 aux layers, not {list(self.aux_layer_ids)}")


class SeqFeatures(TypedDict):
    """One sequence's target features; position i's row describes the target after token i."""
    tokens: mx.array  # [n]
    aux: mx.array  # [n, 3 * hidden]: the residual stream entering the aux layers
    hidden: mx.array  # [n, hidden]: after the final norm (the teacher's logits come from it)
    labels: mx.array  # [n]: the target's argmax, the token it puts at position i + 1
    start: int  # the first answer position


def _layer_inputs(model: nn.Module, ids: mx.array, aux: tuple[int, ...]) -> tuple[mx.array, mx.array]:
    """One plain causal pass over [B, T] -> (final-norm hidden [B, T, d], aux [B, T, 3d]): the inputs of
    the aux layers tapped the way `adapter.hidden_states` taps them for serving."""
    from mlx_lm.models.cache import make_prompt_cache  # mlx_lm loads transformers (~2 s)

    with adapter.layer_input_taps(model, aux) as seen:
        h = model.model(ids, cache=make_prompt_cache(model))
    return h, mx.concatenate(seen, axis=-1)


def sequence_features(target: LoadedModel, seqs: list[list[int]], aux: tuple[int, ...], starts: list[int],
                      dtype: mx.Dtype = mx.float16) -> list[SeqFeatures]:
    """`SeqFeatures` of a right-padded batch (padding comes after the causal rows it would disturb)."""
    width = max(len(q) for q in seqs)
    ids = mx.array([q + [0] * (width - len(q)) for q in seqs], dtype=mx.int32)
    h, a = _layer_inputs(target.model, ids, aux)
    labels = mx.argmax(adapter.compute_logits(target.model, h), axis=-1).astype(mx.int32)
    out: list[SeqFeatures] = [
        {"tokens": ids[i, :n], "aux": a[i, :n].astype(dtype), "hidden": h[i, :n].astype(dtype),
         "labels": labels[i, :n], "start": start}
        for i, (n, start) in enumerate(zip(map(len, seqs), starts, strict=True))]
    mx.eval([[f["tokens"], f["aux"], f["hidden"], f["labels"]] for f in out])
    return out


def all_features(target: LoadedModel, seqs: list[list[int]], aux: tuple[int, ...], starts: list[int],
                 progress: bool) -> list[SeqFeatures]:
    """`sequence_features` in batches of 8 of similar length (little padding), in `seqs`' order."""
    by_len = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    got: dict[int, SeqFeatures] = {}
    for lo in tqdm(range(0, len(seqs), 8), desc="target features", disable=not progress):
        idx = by_len[lo: lo + 8]
        got.update(zip(idx, sequence_features(target, [seqs[i] for i in idx], aux, [starts[i] for i in idx]),
                       strict=True))
    return [got[i] for i in range(len(seqs))]


def _answer_counts(feats: list[SeqFeatures]) -> Counter[int]:
    return Counter(t for f in feats for t in int_list(f["tokens"][f["start"]:]))


def draft_vocabulary(feats: list[SeqFeatures], size: int, vocab: int) -> tuple[list[int], float]:
    """The `size` most frequent answer tokens (ties: the lower id; padded with the lowest unused ids),
    ascending as d2t wants them, and the share of answer tokens they cover."""
    counts = _answer_counts(feats)
    size = min(size, vocab)
    chosen = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    taken = set(chosen)
    chosen += [t for t in range(vocab) if t not in taken][: size - len(chosen)]
    return sorted(chosen), share_covered(counts, chosen)


def output_rows(target: LoadedModel, ids: list[int]) -> mx.array:
    """The target's output-layer rows for `ids` [len, hidden] float32 (tied: the embeddings' rows)."""
    idx = mx.array(ids, dtype=mx.int32)
    head = getattr(target.model, "lm_head", None)
    if head is None:
        return target.model.model.embed_tokens(idx).astype(mx.float32)
    if type(head) is nn.Linear:
        return head.weight[idx].astype(mx.float32)
    # Quantized or packed: the transposed product with the identity, then the rows.
    eye = mx.eye(int(target.model.args.hidden_size), dtype=mx.float32)
    return head(eye).T[idx].astype(mx.float32)


def head_config(target: LoadedModel, draft_vocab: int, aux: tuple[int, ...], k: int,
                intermediate_size: int | None = None) -> dict[str, Any]:
    """config.json in the speculators layout: the layer shaped as the target's own (speculators copies the
    verifier's config), residual from the normed hidden (speculators' and vLLM's default)."""
    t, args = target.config, target.model.args
    check_width(intermediate_size)
    n_kv, head_dim = adapter.kv_shape(target.model)
    h = int(args.hidden_size)
    inter = int(args.intermediate_size) if intermediate_size is None else intermediate_size
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
             "num_attention_heads": int(args.num_attention_heads), "num_key_value_heads": n_kv,
             "head_dim": head_dim, "intermediate_size": inter,
             "rms_norm_eps": float(args.rms_norm_eps),
             "rope_theta": float(getattr(args, "rope_theta", 10000.0)),
             "rope_scaling": t.get("rope_scaling"), "max_position_embeddings": target.max_position_embeddings,
             "vocab_size": target.vocab_size, "num_hidden_layers": 1, "hidden_act": "silu",
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    return {"speculators_model_type": SPECULATORS_TYPE, "architectures": ["Eagle3DraftModel"],
            "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "target_hidden_size": h,
            "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": list(aux),
            "torch_dtype": "float16",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": target.name,
                                                "architectures": t.get("architectures", [])}}}


class _TargetEmbedding(nn.Module):
    """The target's embeddings, callable from the head but none of its parameters (frozen, never saved)."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self._call = embed.__call__  # not an array or module: Module keeps it out of parameters()

    def __call__(self, ids: mx.array) -> mx.array:
        return self._call(ids)


def _local(name: str) -> str:
    """A speculators tensor name -> the Eagle3Head parameter (the renaming load_eagle3 applies)."""
    return name.removeprefix("layers.0.").removeprefix("self_attn.").removeprefix("mlp.")


def new_head(target: LoadedModel, cfg: Eagle3Config, vocab_ids: list[int], init_std: float) -> Eagle3Head:
    """A fresh head: fc and the layer's projections normal(0, init_std), norms ones, `norm` the target's final
    norm, `lm_head` the target's rows for the vocabulary (frozen), the target's embeddings."""
    head = Eagle3Head(cfg, _TargetEmbedding(target.model.model.embed_tokens))
    for lin in (head.fc, head.q_proj, head.k_proj, head.v_proj, head.o_proj, head.gate_proj, head.up_proj,
                head.down_proj):
        lin.weight = mx.random.normal(lin.weight.shape) * init_std
    norm = target.model.model.norm
    if type(norm) is nn.RMSNorm:  # other norms (Gemma's 1 + w) mean something else by their weight
        head.norm.weight = norm.weight.astype(mx.float32)
    head.lm_head.weight = output_rows(target, vocab_ids)
    head.set_dtype(mx.float32)
    head.lm_head.freeze()
    mx.eval(head.parameters())
    return head


def save_head(head: Eagle3Head, config: dict[str, Any], vocab_ids: list[int], folder: Path,
              dtype: mx.Dtype) -> None:
    """config.json and model.safetensors (speculators names, d2t offsets; no embeddings) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(tree_flatten(head.parameters()))
    names = [n for n in head.cfg.tensor_shapes() if n != "d2t"]
    tensors = {n: params[_local(n)].astype(dtype) for n in names}
    vd, vocab = head.cfg.draft_vocab_size, head.cfg.vocab_size
    if vd != vocab:
        sel = np.array(vocab_ids, dtype=np.int64)
        tensors["d2t"] = mx.array(sel - np.arange(vd, dtype=np.int64))
        mask = np.zeros(vocab, dtype=np.bool_)
        mask[sel] = True
        tensors["t2d"] = mx.array(mask)  # speculators writes it; serving reads d2t only
    mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def load_head(target: LoadedModel, folder: Path) -> tuple[Eagle3Head, list[int]]:
    """A head `save_head` wrote, for training again (lm_head frozen), and its vocabulary."""
    cfg = read_config(folder)
    head = Eagle3Head(cfg, _TargetEmbedding(target.model.model.embed_tokens))
    weights = load_arrays(str(folder / "model.safetensors"))
    head.load_weights([(_local(n), w.astype(mx.float32)) for n, w in weights.items()
                       if n in cfg.tensor_shapes() and n != "d2t"])
    d2t = weights.get("d2t")
    vocab = list(range(cfg.draft_vocab_size)) if d2t is None else \
        int_list(mx.arange(cfg.draft_vocab_size, dtype=mx.int32) + d2t.astype(mx.int32))
    head.lm_head.freeze()
    mx.eval(head.parameters())
    return head, vocab


def narrowed_head(target: LoadedModel, folder: Path, counts: Counter[int], draft_vocab_size: int,
                  intermediate_size: int | None) -> tuple[Eagle3Head, list[int], dict[str, Any]]:
    """A trained head to train on: its vocabulary cut to the `draft_vocab_size` tokens most frequent in
    `counts` (the new answers'; lm_head holds the target's rows, so the kept rows score as before), its MLP
    cut to the `intermediate_size` neurons of largest |gate| * |up| * |down| norms; neither ever grows."""
    old, vocab = load_head(target, folder)
    config = json.loads((folder / "config.json").read_text())
    if draft_vocab_size < len(vocab):
        vocab = sorted(sorted(vocab, key=lambda t: (-counts[t], t))[:draft_vocab_size])
        config["draft_vocab_size"] = len(vocab)
    params = dict(tree_flatten(old.trainable_parameters()))
    if intermediate_size is not None and intermediate_size < old.cfg.intermediate_size:
        check_width(intermediate_size)
        cut = strongest_neurons(old.gate_proj.weight, old.up_proj.weight, old.down_proj.weight,
                                intermediate_size)
        params.update(zip(("gate_proj.weight", "up_proj.weight", "down_proj.weight"), cut, strict=True))
        config["transformer_layer_config"]["intermediate_size"] = intermediate_size
    head = Eagle3Head(parse_config(config, folder / "config.json"), old.embed)
    head.load_weights(list(params.items()), strict=False)  # lm_head: below
    head.lm_head.weight = output_rows(target, vocab)  # the target's own rows, not a float16 copy
    head.set_dtype(mx.float32)
    head.lm_head.freeze()
    mx.eval(head.parameters())
    return head, vocab, config


def _shift(a: mx.array, start: int, rows: int, fill: float = 0.0) -> mx.array:
    """a[:, start : start + rows] along axis 1, padded with `fill` to `rows` rows."""
    part = a[:, start: start + rows]
    pad = rows - part.shape[1]
    if pad <= 0:
        return part
    widths = [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)
    return mx.pad(part, widths, constant_values=fill)


def _project(head: Eagle3Head, emb: mx.array, hidden: mx.array,
             positions: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Eagle3Head.__call__'s inputs to attention for [B, R] rows: q [B, R, Hq, D], k and v [B, R, Hkv, D]
    (RoPE at `positions` [B * R]), and the normed hidden."""
    cfg = head.cfg
    b, r = emb.shape[:2]
    g = head.hidden_norm(hidden)
    x = mx.concatenate([head.input_layernorm(emb.astype(hidden.dtype)), g], axis=-1)  # the embedding first

    def rope(y: mx.array, n: int) -> mx.array:  # each row its own batch entry: one position per row
        y = head.rope(y.reshape(b * r, n, 1, cfg.head_dim), offset=positions)
        return y.reshape(b, r, n, cfg.head_dim)

    q = rope(head.q_proj(x), cfg.num_heads)
    k = rope(head.k_proj(x), cfg.num_kv_heads)
    return q, k, head.v_proj(x).reshape(b, r, cfg.num_kv_heads, cfg.head_dim), g


def _attend(head: Eagle3Head, q: mx.array, keys: mx.array, values: mx.array,
            chain: list[tuple[mx.array, mx.array]]) -> mx.array:
    """Row j's queries over step 0's keys of rows <= j and its own chain's keys (`chain`: steps 1..k of the
    same row) -> [B, R, Hq * D]."""
    cfg = head.cfg
    rep = cfg.num_heads // cfg.num_kv_heads
    b, r = q.shape[:2]
    scores = mx.einsum("bjhd,bihd->bhji", q, mx.repeat(keys, rep, axis=2)) * head.scale
    scores = mx.where(mx.tril(mx.ones((r, r), dtype=mx.bool_)), scores, -mx.inf)
    own = [(q * mx.repeat(k, rep, axis=2)).sum(-1).transpose(0, 2, 1)[..., None] * head.scale
           for k, _ in chain]
    p = mx.softmax(mx.concatenate([scores, *own], axis=-1), axis=-1, precise=True)
    out = mx.einsum("bhji,bihd->bjhd", p[..., :r], mx.repeat(values, rep, axis=2))
    for m, (_, v) in enumerate(chain):
        out = out + p[..., r + m].transpose(0, 2, 1)[..., None] * mx.repeat(v, rep, axis=2)
    return out.reshape(b, r, cfg.num_heads * cfg.head_dim)


def ttt_logits(head: Eagle3Head, emb: mx.array, aux: mx.array, steps: int) -> list[mx.array]:
    """Per TTT step, draft-vocabulary logits [B, R = N - 1, Vd] for embeddings emb [B, N, d] of the tokens
    and aux [B, N, 3d]: row j of step k reads token j + k + 1 at RoPE position j + k and drafts position
    j + k + 2 (step 0 is the serving catch-up pass; the math is Eagle3Head.__call__'s)."""
    b, n = emb.shape[:2]
    r = n - 1
    hidden = head.fuse(aux[:, :r].astype(mx.float32))
    rows = mx.tile(mx.arange(r), (b,))
    out: list[mx.array] = []
    context: tuple[mx.array, mx.array] | None = None
    chain: list[tuple[mx.array, mx.array]] = []
    for k in range(steps):
        q, kk, v, g = _project(head, _shift(emb, 1 + k, r), hidden, rows + k)
        if context is None:
            context = (kk, v)
        else:
            chain.append((kk, v))
        att = _attend(head, q, context[0], context[1], chain)
        h1 = (g if head.cfg.norm_before_residual else hidden) + head.o_proj(att)
        y = head.post_attention_layernorm(h1)
        hidden = h1 + head.down_proj(nn.silu(head.gate_proj(y)) * head.up_proj(y))
        out.append(head.lm_head(head.norm(hidden)))
    return out


@dataclass
class Batch:
    emb: mx.array  # [B, N, d]
    aux: mx.array  # [B, N, 3d]
    logp: mx.array  # [B, N, Vd]: the target's log-probabilities over the draft vocabulary for position i + 1
    rows: mx.array  # [B, N]: the draft row of the target's argmax at i (-1: outside the draft vocabulary)
    start: mx.array  # [B, 1]: the first answer position
    length: mx.array  # [B, 1]

    def answer(self, k: int) -> mx.array:
        """[B, R]: rows of step k whose drafted position j + k + 2 is an answer token of the sequence."""
        p = mx.arange(self.emb.shape[1] - 1)[None] + 2 + k
        return (p >= self.start) & (p < self.length)


@dataclass
class Teacher:
    """What batches read from the target: embeddings, its output rows for the draft vocabulary."""
    embed: nn.Module
    t2d: mx.array  # [V]: token id -> draft row, -1 outside
    rows: mx.array  # [Vd, d]
    cap: float | None  # final logit soft-capping

    def batch(self, feats: list[SeqFeatures]) -> Batch:
        n = max(int(f["tokens"].shape[0]) for f in feats)

        def pad(a: mx.array) -> mx.array:
            return mx.pad(a, [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1))

        tokens = mx.stack([pad(f["tokens"]) for f in feats])
        logits = mx.stack([pad(f["hidden"]) for f in feats]).astype(mx.float32) @ self.rows.T
        if self.cap:
            logits = mx.tanh(logits / self.cap) * self.cap
        return Batch(emb=self.embed(tokens).astype(mx.float32), aux=mx.stack([pad(f["aux"]) for f in feats]),
                     logp=logits - mx.logsumexp(logits, axis=-1, keepdims=True),
                     rows=self.t2d[mx.stack([pad(f["labels"]) for f in feats])],
                     start=mx.array([[f["start"]] for f in feats]),
                     length=mx.array([[int(f["tokens"].shape[0])] for f in feats]))


def ttt_loss(head: Eagle3Head, batch: Batch, steps: int) -> tuple[mx.array, list[mx.array]]:
    """Mean over steps of the soft cross-entropy on answer rows whose target argmax is in the draft
    vocabulary; and per step, [agreeing rows, answer rows] (outside the draft vocabulary: a miss)."""
    logits = ttt_logits(head, batch.emb, batch.aux, steps)
    r = batch.emb.shape[1] - 1
    total = mx.array(0.0)
    counts = []
    for k, z in enumerate(logits):
        answer = batch.answer(k)
        target, row = _shift(batch.logp, 1 + k, r), _shift(batch.rows, 1 + k, r, fill=-1)
        keep = answer & (row >= 0)
        ce = -(mx.exp(target) * (z - mx.logsumexp(z, axis=-1, keepdims=True))).sum(-1)
        total = total + (ce * keep).sum() / mx.maximum(keep.sum(), 1)
        counts.append(mx.stack([((mx.argmax(z, axis=-1) == row) & answer).sum(), answer.sum()]))
    return total / steps, counts


def agreement(head: Eagle3Head, feats: list[SeqFeatures], teacher: Teacher,
              steps: int = EVAL_STEPS) -> list[float]:
    """Per TTT step, the share of answer rows whose draft is the target's argmax (teacher-forced tokens:
    step k's figure is draft k + 1's acceptance given the drafts before it were accepted)."""
    hits, total = [0.0] * steps, [0.0] * steps
    for lo in range(0, len(feats), 8):
        _, counts = ttt_loss(head, teacher.batch(feats[lo: lo + 8]), steps)
        for k, c in enumerate(counts):
            hits[k] += float(c[0])
            total[k] += float(c[1])
    return [h / t if t else 0.0 for h, t in zip(hits, total, strict=True)]


def _optimizer(s: Eagle3Settings) -> optim.Optimizer:
    return optim.AdamW(learning_rate=warmup_cosine(s.lr, s.steps, s.warmup), weight_decay=0.0)


def _train_steps(head: Eagle3Head, opt: optim.Optimizer, start: int, feats: list[SeqFeatures],
                 held: list[SeqFeatures], teacher: Teacher, save: Any, s: Eagle3Settings,
                 progress: bool) -> tuple[list[float], dict[int, float]]:
    """Train from `start` to `s.steps`, calling `save(step)` every `save_every`; -> the losses and held-out
    first-draft top-1 every `eval_every` steps."""
    loss_grad = nn.value_and_grad(head, lambda b: ttt_loss(head, b, s.ttt_steps)[0])
    order = epoch_order(len(feats), s.steps * s.batch_size, s.seed)
    losses: list[float] = []
    evals: dict[int, float] = {}
    bar = tqdm(total=s.steps, initial=start, desc="training eagle3 head", disable=not progress)
    for step in range(start, s.steps):
        pick = order[step * s.batch_size: (step + 1) * s.batch_size]
        loss, grads = loss_grad(teacher.batch([feats[i] for i in pick]))
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if (step + 1) % s.save_every == 0 or step + 1 == s.steps:
            save(step + 1)
        if held and (step + 1) % s.eval_every == 0 and step + 1 < s.steps:
            evals[step + 1] = agreement(head, held, teacher, 1)[0]
            bar.write(f"step {step + 1}: held-out first-draft top-1 {evals[step + 1]:.4f}")
    bar.close()
    return losses, evals


def _answers(target: LoadedModel, prompts: list[str], s: Eagle3Settings,
             data_file: Path) -> tuple[list[list[int]], list[int]]:
    """The target's greedy answers (prompt + answer ids; reused from `data_file`) and where each starts."""
    gen = TrainSettings(max_tokens=s.max_new_tokens, max_num_seqs=s.max_num_seqs, samples_per_prompt=1,
                        seed=s.seed)
    seqs = generate_texts(target, prompts, gen, data_file)
    return seqs, [min(chat_length(target, p), len(q) - 1) for p, q in zip(prompts, seqs, strict=True)]


def _data(target: LoadedModel, out: Path, prompts_path: Path, heldout_path: Path | None, s: Eagle3Settings,
          aux: tuple[int, ...], progress: bool) -> tuple[list[SeqFeatures], list[SeqFeatures]]:
    """(training features, held-out features) of the target's own answers (generated, or from out/data)."""
    prompts = read_prompts(prompts_path)
    prompts = prompts[: s.max_sequences] if s.max_sequences else prompts
    if not prompts:
        raise ValueError(f"no prompts in {prompts_path}")
    seqs, starts = _answers(target, prompts, s, out / "data" / "sequences.jsonl")
    train = all_features(target, seqs, aux, starts, progress)
    held: list[SeqFeatures] = []
    if heldout_path is not None:
        seqs, starts = _answers(target, read_prompts(heldout_path), s, out / "data" / "heldout.jsonl")
        held = all_features(target, seqs, aux, starts, progress)
    return train, held


def _head_and_optimizer(target: LoadedModel, out: Path, train: list[SeqFeatures], s: Eagle3Settings,
                        aux: tuple[int, ...],
                        resume: bool) -> tuple[Eagle3Head, list[int], optim.Optimizer, dict]:
    """The head (fresh, `s.init`'s, or out/checkpoint's with `resume`), its vocabulary, the optimizer and
    the state (its config.json under "config")."""
    ck = out / "checkpoint"
    opt = _optimizer(s)
    if resume and (ck / "state.json").exists():
        head, vocab = load_head(target, ck)
        if head.cfg.aux_layer_ids != aux:
            raise ValueError(f"{ck} reads aux layers {head.cfg.aux_layer_ids}, not {aux}")
        state = json.loads((ck / "state.json").read_text())
        restore_optimizer(ck, opt, head.trainable_parameters())
        return head, vocab, opt, {**state, "config": json.loads((ck / "config.json").read_text())}
    if s.init is not None:
        counts = _answer_counts(train)
        head, vocab, config = narrowed_head(target, s.init, counts, s.draft_vocab_size, s.intermediate_size)
        (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        return head, vocab, opt, {"step": 0, "coverage": share_covered(counts, vocab), "config": config}
    vocab, coverage = draft_vocabulary(train, s.draft_vocab_size, target.vocab_size)
    config = head_config(target, len(vocab), aux, s.ttt_steps, s.intermediate_size)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    head = new_head(target, read_config(out), vocab, s.init_std)  # read back as serving reads it
    return head, vocab, opt, {"step": 0, "coverage": coverage, "config": config}


def train_eagle3(target: LoadedModel, out: Path, prompts_path: Path = DEFAULT_PROMPTS,
                 heldout_path: Path | None = DEFAULT_HELDOUT, s: Eagle3Settings | None = None,
                 resume: bool = False, progress: bool = True) -> dict:
    """Generate (or reuse) the self-distilled data, train (or resume), write `out/` for `method: eagle3`."""
    s = s or Eagle3Settings()
    if not resume and (out / "checkpoint" / "state.json").exists():
        raise ValueError(f"{out / 'checkpoint'} holds a checkpoint: pass --resume to continue it, or "
                         "choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(s.seed)
    aux = tuple(sorted(s.aux_layer_ids or default_aux_layers(len(target.model.layers))))
    if s.init is not None and (got := read_config(s.init).aux_layer_ids) != aux:  # before data is made
        raise ValueError(f"{s.init} reads aux layers {got}, not {aux}")
    adapter.aux_order(aux, len(target.model.layers))  # refuses repeated or out-of-range ids
    train, held = _data(target, out, prompts_path, heldout_path, s, aux, progress)
    head, vocab, opt, state = _head_and_optimizer(target, out, train, s, aux, resume)
    t2d = np.full(target.vocab_size, -1, dtype=np.int32)
    t2d[vocab] = np.arange(len(vocab))
    teacher = Teacher(target.model.model.embed_tokens, mx.array(t2d), output_rows(target, vocab),
                      getattr(target.model.args, "final_logit_softcapping", None))
    sample = train[-8:]  # the training-side sanity figure
    if state["step"] == 0:
        state["untrained"] = {"held_out": agreement(head, held, teacher) if held else [],
                              "train": agreement(head, sample, teacher)}
    config = state.pop("config")

    def save(step: int) -> None:
        save_head(head, config, vocab, out / "checkpoint", mx.float32)
        save_optimizer(out / "checkpoint", opt, {**state, "step": step})

    t0 = time.monotonic()
    losses, evals = _train_steps(head, opt, state["step"], train, held, teacher, save, s, progress)
    per_step = (time.monotonic() - t0) / max(1, len(losses))
    save_head(head, config, vocab, out, mx.float16)
    summary = _summary(head, train, held, teacher, s, state, losses, evals, per_step)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _summary(head: Eagle3Head, train: list[SeqFeatures], held: list[SeqFeatures], teacher: Teacher,
             s: Eagle3Settings, state: dict, losses: list[float], evals: dict[int, float],
             per_step: float) -> dict:
    tenth = max(1, len(losses) // 10)

    def named(xs: list[float]) -> dict[str, float]:
        return {f"draft{k + 1}": round(x, 4) for k, x in enumerate(xs)}

    held_now = agreement(head, held, teacher) if held else []
    return {"init": str(s.init) if s.init else None, "intermediate_size": head.cfg.intermediate_size,
            "lr": s.lr, "sequences": len(train), "tokens": sum(int(f["tokens"].shape[0]) for f in train),
            "answer_tokens": sum(int(f["tokens"].shape[0]) - f["start"] for f in train),
            "held_out_sequences": len(held), "draft_vocab_size": head.cfg.draft_vocab_size,
            "draft_vocab_coverage": round(state["coverage"], 4), "ttt_steps": s.ttt_steps, "steps": s.steps,
            # Means over the first and the last tenth of this run's steps.
            "initial_loss": sum(losses[:tenth]) / tenth if losses else None,
            "final_loss": sum(losses[-tenth:]) / tenth if losses else None,
            "s_per_step": round(per_step, 3),
            # Top-1 agreement with the target's argmax on answer tokens: draft1 is the first draft, draft2
            # and draft3 TTT steps 2 and 3 (given the drafts before them were right).
            "held_out_top1": named(held_now),
            # "untrained": the head before this run's steps (with --init: the trained head, cut).
            "held_out_top1_untrained": named(state["untrained"]["held_out"]),
            "held_out_first_draft_by_step": {str(k): round(v, 4) for k, v in evals.items()},
            "train_top1": named(agreement(head, train[-8:], teacher)),
            "train_top1_untrained": named(state["untrained"]["train"])}


def settings_from_args(args: argparse.Namespace) -> Eagle3Settings:
    """The flags the user set over Eagle3Settings' defaults; `--max-sequences 0` means every prompt."""
    got = given(args, "max_sequences", "max_new_tokens", "draft_vocab_size", "steps", "batch_size", "lr",
                "ttt_steps", "seed", "intermediate_size")
    if "max_sequences" in got:
        got["max_sequences"] = got["max_sequences"] or None
    if getattr(args, "aux_layers", None):
        try:
            got["aux_layer_ids"] = tuple(sorted(int(x) for x in args.aux_layers.split(",")))
        except ValueError:
            raise ValueError(f"--aux-layers takes comma-separated layer ids, not {args.aux_layers!r}") \
                from None
    return Eagle3Settings(**got, init=Path(args.init) if args.init else None)


def main_cli(args: argparse.Namespace) -> int:
    """`specserve train-eagle3 --out DIR` (the namespace comes from server/cli/train.py)."""
    s = settings_from_args(args)
    prompts = Path(args.prompts) if args.prompts else DEFAULT_PROMPTS
    heldout = DEFAULT_HELDOUT if args.heldout is None else (Path(args.heldout) if args.heldout else None)
    out = Path(args.out)
    rc = run_cli("train-eagle3", args.model,
                 lambda target: train_eagle3(target, out, prompts, heldout, s, resume=args.resume),
                 {"method": "eagle3", "model": str(out), "num_speculative_tokens": s.ttt_steps})
    if rc == 0:
        print(f"saved the EAGLE-3 head to {out} (checkpoint/ and data/ inside are for --resume)")
    return rc
