"""Write a float32, unquantized MLX folder of the default model (for mlx_lm.server comparisons).

    python -m loadtests.export_f32 [OUT]

The weights are exactly what specserve serves on CPU: the default 4-bit folder loaded with
dtype=float32 (dequantized by engine.models.loader). The result is cached and reused.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from engine.models.loader import DEFAULT_MODEL_NAME, cache_dir, default_model_folder, load_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja")
_MARKER = ".float32-export-complete"


def ensure_float32_copy(out: Path | None = None) -> Path:
    out = out or cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-f32-mlx"
    if (out / _MARKER).exists():
        return out
    import mlx.core as mx
    from mlx.utils import tree_flatten

    src = default_model_folder(progress=False)
    loaded = load_model(None, dtype="float32", progress=False)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = dict(tree_flatten(loaded.model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {k: v for k, v in loaded.config.items() if k not in ("quantization", "quantization_config")}
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, tmp / name)
    (tmp / _MARKER).write_text(json.dumps({"source": str(src), "dtype": "float32"}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # complete folders only: an interrupted export leaves no half-written model
    return out


if __name__ == "__main__":
    print(ensure_float32_copy(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
