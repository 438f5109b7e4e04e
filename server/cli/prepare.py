"""`specserve prepare [MODEL]`: download / convert a model once and print where it is."""

from __future__ import annotations

import argparse
import sys
from typing import Any, get_args

from engine.config import DType, Quantization
from server.cli.serve import setup_logging


def add_parser(sub: Any) -> argparse.ArgumentParser:
    prepare = sub.add_parser("prepare", help="download / convert a model once and print where it is",
                             description="Load MODEL once (the default model is converted into the cache "
                                         "folder), print where it is, and exit.")
    prepare.add_argument("model", nargs="?", default=None,
                         help="HF folder, GGUF file or Hub id (default: SmolLM2-135M-Instruct)")
    prepare.add_argument("--dtype", default="auto", choices=list(get_args(DType)))
    prepare.add_argument("--revision", default=None)
    prepare.add_argument("--quantization", default=None, choices=list(get_args(Quantization)),
                         help="write a quantized copy (mlx-lm's converter, affine, group 64) and print it")
    prepare.add_argument("--out", default=None,
                         help="folder for the quantized copy (default: <cache>/models/NAME-qN-mlx)")
    return prepare


def run(args: argparse.Namespace) -> int:
    return prepare(args.model, args.dtype, args.revision, args.quantization, args.out)


def prepare(model: str | None, dtype: DType, revision: str | None, quantization: str | None = None,
            out: str | None = None) -> int:
    from engine.models.loader import load_model, quantized_copy  # imports MLX: after platform.setup()

    setup_logging("info")
    try:
        if quantization:
            folder = quantized_copy(model, quantization, revision, dtype, out)
            print(f"{model} ({quantization}) is ready at {folder}")
            return 0
        loaded = load_model(model, dtype=dtype, revision=revision, progress=True)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"specserve prepare: {e}", file=sys.stderr)
        return 1
    print(f"{loaded.name} is ready at {loaded.path}")
    return 0
