"""MTP assistant checkpoints (Gemma4 `gemma4_assistant` / `gemma4_mtp`) as an MLX module: query-only
decoder layers over the target's paged KV (docs/mtp.md), as in transformers' `models/gemma4_assistant`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from engine.attention.types import AttentionMetadata
from engine.kv.cache import PagedKVCache
from engine.models import adapter
from engine.models.hf_config import mlx_config
from engine.models.loader import LoadedModel, materialize, resolve_source
from engine.models.mtp_trained import check_config, id_out_of_range, load_trained
from engine.models.weights import load_arrays

ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_mtp")
# Every model_type this module loads (specserve_mtp: assistants trained by `specserve train-assistant`).
MTP_MODEL_TYPES = (*ASSISTANT_TYPES, "specserve_mtp")
TARGET_TYPES = ("gemma4", "gemma4_text")


class MTPAssistantError(ValueError):
    pass


def _fail(msg: str) -> MTPAssistantError:
    return MTPAssistantError(f"invalid --speculative-config: model: {msg}")


class ReadOnlyPagedCache(adapter.PagedLayerCache):
    """A target layer's paged KV seen by an assistant layer: attention reads it, nothing is written."""

    def __init__(self, kv: PagedKVCache, layer: int, window: int | None) -> None:
        super().__init__(kv, layer, window, writes=False)

    def attention(self, queries: mx.array, scale: float) -> mx.array:
        # queries: [N, H, 1, D] (one query row per request) -> [N, H, 1, D]
        assert self.meta is not None
        kb, vb = self.kv.blocks(self.layer)
        n, h, _, d = queries.shape
        out = self.attention_fn(queries.reshape(n, h, d), kb, vb, self.meta, scale, self.window)
        return out.reshape(n, h, 1, d)


def kv_source_layers(target_types: list[str], num_kv_shared: int, assistant_types: list[str]) -> list[int]:
    """Target layer each assistant layer reads: the last non-KV-shared target layer of the same type."""
    m = len(target_types) - num_kv_shared
    last: dict[str, int] = {}
    for i in range(m):
        last[target_types[i]] = i
    missing = sorted({t for t in assistant_types if t not in last})
    if missing:
        raise _fail(f"the target has no non-shared layer of attention type(s) {missing}")
    return [last[t] for t in assistant_types]


class _AssistantText(nn.Module):
    """mlx-lm's Gemma4 decoder layers, all KV-shared (Gemma4TextModel needs KV-producing ones)."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        from mlx_lm.models.gemma4_text import DecoderLayer  # mlx_lm loads transformers (~2 s)

        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Gemma4Assistant(nn.Module):
    """Weights: `text` (all layers KV-shared), the two projections and the optional centroid head."""

    def __init__(self, config: dict, text_args: Any) -> None:
        super().__init__()
        self.config = config
        self.text_args = text_args
        self.text = _AssistantText(text_args)
        hidden, backbone = text_args.hidden_size, int(config["backbone_hidden_size"])
        self.pre_projection = nn.Linear(2 * backbone, hidden, bias=False)
        self.post_projection = nn.Linear(hidden, backbone, bias=False)
        self.use_ordered = bool(config.get("use_ordered_embeddings", False))
        if self.use_ordered:
            self.centroids = nn.Linear(hidden, int(config["num_centroids"]), bias=False)
            self.token_ordering = mx.zeros((text_args.vocab_size,), dtype=mx.int32)
        adapter.install(self.text.layers[0])  # route the gemma4_text module's attention to paged KV

    def logits(self, h: mx.array) -> mx.array:
        """h: [N, hidden] (after the final norm) -> [N, vocab]."""
        emb = self.text.embed_tokens
        if not self.use_ordered:
            return emb.as_linear(h)
        # Ordered-embedding head: score only the tokens of the top-k centroids; the rest get min - 1.
        n_c = self.centroids.weight.shape[0]
        vocab = emb.weight.shape[0]
        top_k = int(self.config.get("centroid_intermediate_top_k", 32))
        top = mx.argpartition(-self.centroids(h), kth=top_k - 1, axis=-1)[:, :top_k]  # [N, top_k]
        per = self.token_ordering.astype(mx.int32).reshape(n_c, vocab // n_c)
        cand = per[top].reshape(h.shape[0], -1)  # [N, top_k * vocab/n_c] canonical token ids
        sel = (emb.weight[cand] * h[:, None, :]).sum(-1)  # [N, C]
        fill = sel.min(axis=-1, keepdims=True) - 1.0  # per row: batching does not change a row's logits
        out = mx.broadcast_to(fill, (h.shape[0], vocab)).astype(h.dtype)
        return mx.put_along_axis(out, cand, sel, axis=-1)

    def __call__(self, x: mx.array, positions: mx.array | int, caches: list[ReadOnlyPagedCache]
                 ) -> tuple[mx.array, mx.array]:
        """x: [N, 2 * backbone] = [scaled target embedding, target hidden]; positions: [N] (or one int).
        -> (logits [N, vocab], post_projection output [N, backbone])."""
        h = self.pre_projection(x)[:, None, :]  # [N, 1, hidden]: one row per request
        dummy = (mx.zeros((1,)), mx.zeros((1,)))  # K/V come from the target cache inside attention
        for layer, cache in zip(self.text.layers, caches, strict=True):
            h, _, _ = layer(h, None, cache, per_layer_input=None, shared_kv=dummy, offset=positions)
        h = self.text.norm(h[:, 0, :])
        return self.logits(h), self.post_projection(h)


def _read_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _fail(f"no *.safetensors weights in {path}")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(load_arrays(str(f)))
    return weights


def _token_ordering(order: mx.array | None, net: Gemma4Assistant) -> mx.array:
    """The centroid head's token ids ([vocab]): the logits gather embedding rows with them."""
    vocab, n_c = net.text_args.vocab_size, net.centroids.weight.shape[0]
    top_k = int(net.config.get("centroid_intermediate_top_k", 32))
    if order is None:
        raise _fail("use_ordered_embeddings is set but the weights lack masked_embedding.token_ordering")
    if tuple(order.shape) != (vocab,) or not mx.issubdtype(order.dtype, mx.integer):
        raise _fail(f"token_ordering: shape {tuple(order.shape)} {order.dtype}, expected ({vocab},) "
                    f"integer ids (vocab_size {vocab})")
    bad = id_out_of_range(order, vocab)
    if bad is not None:
        raise _fail(f"token_ordering: token id {bad} is outside the vocabulary [0, {vocab})")
    if n_c <= 0 or vocab % n_c or not 0 < top_k <= n_c:
        raise _fail(f"num_centroids {n_c} must divide vocab_size {vocab} and be at least "
                    f"centroid_intermediate_top_k {top_k}")
    return order.astype(mx.int32)


def check_assistant_config(config: dict, target: nn.Module, target_config: dict) -> Any:
    """Start-up checks (no fallback); returns the assistant's mlx-lm text args."""
    from mlx_lm.models.gemma4_text import ModelArgs  # mlx_lm loads transformers (~2 s)

    mt = config.get("model_type")
    if mt not in ASSISTANT_TYPES:
        raise _fail(f"model_type {mt!r} is not an MTP assistant (expected one of {list(ASSISTANT_TYPES)})")
    archs = config.get("architectures") or []
    if archs and not any("Assistant" in a or "MTP" in a for a in archs):
        raise _fail(f"architectures {archs} is not an MTP assistant architecture")
    tmt = target_config.get("model_type")
    if tmt not in TARGET_TYPES:
        raise _fail(f"model_type mismatch: a {mt} assistant needs a gemma4 / gemma4_text target, "
                    f"not {tmt!r}")
    text = dict(config.get("text_config") or {})
    n = int(text.get("num_hidden_layers", 0))
    text["num_kv_shared_layers"] = n  # every assistant layer reads the target's KV
    if text.get("enable_moe_block"):
        raise _fail("MoE assistants (enable_moe_block) are not supported")
    if text.get("hidden_size_per_layer_input") or text.get("vocab_size_per_layer_input"):
        raise _fail("assistants with per-layer inputs (hidden_size_per_layer_input) are not supported")
    if text.get("use_double_wide_mlp"):
        raise _fail("assistants with use_double_wide_mlp are not supported")
    targs = target.args
    t_vocab = int(target_config.get("vocab_size") or targs.vocab_size)
    if int(text.get("vocab_size", -1)) != t_vocab:
        raise _fail(f"vocabulary size mismatch: assistant {text.get('vocab_size')} vs target {t_vocab}")
    backbone = config.get("backbone_hidden_size")
    if backbone != targs.hidden_size:
        raise _fail(f"hidden size mismatch: assistant backbone_hidden_size {backbone} vs target hidden_size "
                    f"{targs.hidden_size}")
    args = ModelArgs.from_dict(text)
    t_types = list(targs.layer_types)
    if n > len(t_types) or args.layer_types != t_types[len(t_types) - n:]:
        raise _fail(f"layer types {args.layer_types} do not match the tail of the target's layers "
                    f"{t_types[len(t_types) - n:]}")
    return args


@dataclass
class LoadedAssistant:
    module: Gemma4Assistant  # or engine.models.mtp_trained.TrainedAssistant (same call signature)
    target_layers: list[int]  # target KV layer each assistant layer reads
    windows: list[int | None]  # sliding window per assistant layer
    path: str
    # Token id of each logit row where the head scores a reduced vocabulary (None: row i is token i).
    head_token_ids: mx.array | None = None


def load_assistant(path: str, target: LoadedModel, revision: str | None = None,
                   ) -> LoadedAssistant:
    """Load and check an assistant against the target (raises MTPAssistantError). `path`: a folder or a Hub
    id at `revision`."""
    folder = Path(path).expanduser()
    if not folder.exists():
        try:
            folder = resolve_source(path, revision)[1]
        except (OSError, ValueError) as e:  # not a Hub id, not in the cache offline, no such revision
            raise _fail(f"{path!r} is not a folder with a config.json, nor a Hub id found ({e})") from e
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise _fail(f"{path!r} is not a folder with a config.json")
    config = mlx_config(json.loads(cfg_file.read_text()))
    if config.get("model_type") == "specserve_mtp":
        return _load_trained(folder, config, target)
    targs = target.model.args
    args = check_assistant_config(config, target.model, target.config)
    sources = kv_source_layers(list(targs.layer_types), int(getattr(targs, "num_kv_shared_layers", 0) or 0),
                               list(args.layer_types))
    net = Gemma4Assistant(config, args)
    shapes = adapter.kv_layout(target.model).shapes
    for i, (layer, src) in enumerate(zip(net.text.layers, sources, strict=True)):
        attn = layer.self_attn
        n_kv, head_dim = shapes[src]  # type: ignore[misc]  # a source stores KV (kv_source_layers)
        if attn.head_dim != head_dim or attn.n_kv_heads != n_kv or attn.n_heads % n_kv:
            raise _fail(f"architecture mismatch: assistant layer {i} ({args.layer_types[i]}) has head_dim "
                        f"{attn.head_dim}, {attn.n_heads} heads and {attn.n_kv_heads} KV heads; the target "
                        f"layer {src} KV it reads has head_dim {head_dim} and {n_kv} KV heads")
    raw = _read_weights(folder)
    weights: dict[str, mx.array] = {}
    for k, v in raw.items():
        if k.startswith("model."):
            weights["text." + k[len("model."):]] = v
        elif k.startswith("masked_embedding."):
            weights[k[len("masked_embedding."):]] = v
        elif k == "lm_head.weight":
            continue  # tied to model.embed_tokens
        else:
            weights[k] = v
    if net.use_ordered:
        weights["token_ordering"] = _token_ordering(weights.get("token_ordering"), net)
    try:
        net.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise _fail(f"architecture mismatch: weights of {path!r} do not match its config: {e}") from e
    dtype = target.dtype
    keep_int = tree_map_with_path(lambda k, v: v if k == "token_ordering" else v.astype(dtype),
                                  net.parameters())
    net.update(keep_int)
    materialize(net)
    windows = [args.sliding_window if t == "sliding_attention" else None for t in args.layer_types]
    return LoadedAssistant(module=net, target_layers=sources, windows=windows, path=str(folder))


def _load_trained(folder: Path, config: dict, target: LoadedModel) -> LoadedAssistant:
    """A `specserve train-assistant` checkpoint, checked against its target (the C draft loop indexes the
    target's KV and embedding with these sizes)."""

    targs = target.model.args
    tmt = target.config.get("model_type")
    if config.get("target_model_type") != tmt:
        want = config.get("target_model_type")
        raise _fail(f"model_type mismatch: the assistant was trained for a {want!r} target, not {tmt!r}")
    try:
        check_config(config)
    except ValueError as e:
        raise _fail(f"{folder / 'config.json'}: {e}") from e
    try:
        n_kv, head_dim = adapter.kv_shape(target.model)
    except ValueError as e:
        raise _fail(f"trained assistants need a target with one KV shape across layers: {e}") from e
    for what, key, want in (("vocabulary size", "vocab_size", target.vocab_size),
                            ("hidden size", "backbone_hidden_size", targs.hidden_size),
                            ("KV heads", "num_key_value_heads", n_kv), ("head size", "head_dim", head_dim)):
        if int(config[key]) != want:
            raise _fail(f"{what} mismatch: assistant {key} {config[key]} vs target {want}")
    layer, n_layers = config.get("target_layer"), len(target.model.layers)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise _fail(f"target_layer {layer!r} is not a layer of the target (0 to {n_layers - 1})")
    try:
        net = load_trained(folder, config, target.dtype)
    except ValueError as e:
        raise _fail(f"checkpoint {folder}: {e}") from e
    return LoadedAssistant(module=net, target_layers=[layer], windows=[None], path=str(folder),  # type: ignore[arg-type]
                           head_token_ids=net.vocab_ids)


def make_caches(assistant: LoadedAssistant, kv: PagedKVCache, meta: AttentionMetadata,
                attention_fn: Any = None) -> list[ReadOnlyPagedCache]:
    """One read-only view of the target's paged KV per assistant layer, sharing this step's metadata."""
    caches = []
    for layer, window in zip(assistant.target_layers, assistant.windows, strict=True):
        c = ReadOnlyPagedCache(kv, layer, window)
        c.meta = meta
        if attention_fn is not None:
            c.attention_fn = attention_fn
        caches.append(c)
    return caches
