"""`specserve train-assistant` and `specserve train-draft`: the command lines of engine/training/."""

from __future__ import annotations

import argparse
from typing import Any


def add_parsers(sub: Any) -> None:
    # Numeric training flags default to None: the defaults live in TrainSettings / DraftSettings.
    train = sub.add_parser("train-assistant", help="self-distil an MTP assistant for MODEL (method: mtp)",
                           description="The target writes its own training text, then a small assistant "
                                       "learns its next-next token on MLX. Resumable: rerun to continue.")
    train.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    train.add_argument("--out", required=True, help="output folder (checkpoint/ and data/ go inside)")
    train.add_argument("--prompts", default=None, help="JSONL of {\"prompt\": ...} (default: configs/)")
    train.add_argument("--steps", type=int, help="training steps")
    train.add_argument("--max-prompts", type=int, help="prompts used from the set (0: all)")
    train.add_argument("--mix-sampled", action="store_true",
                       help="answer odd prompts with sampling (default: greedy only, as drafting sees)")
    train.add_argument("--head-size", type=int, help="reduced vocabulary of the head")
    train.add_argument("--intermediate-size", type=int,
                       help="MLP width of the assistant's layer (default: a sixth of the target's)")
    train.add_argument("--max-tokens", type=int, help="tokens generated per answer")
    train.add_argument("--seed", type=int)
    train.add_argument("--answer-only", action="store_true",
                       help="score answer positions only (default: every position)")
    draft = sub.add_parser("train-draft", help="distil a small draft model for MODEL (method: draft_model)",
                           description="The target's first layers, trained on the text the target writes "
                                       "itself. Resumable: rerun to continue.")
    draft.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    draft.add_argument("--out", required=True, help="output folder (a Hugging Face-layout model)")
    draft.add_argument("--data", default=None,
                       help="reuse generated text: a sequences.jsonl written by train-assistant/train-draft")
    draft.add_argument("--prompts", default=None, help="JSONL of {\"prompt\": ...} (default: configs/)")
    draft.add_argument("--num-layers", type=int, help="target layers the draft keeps")
    draft.add_argument("--steps", type=int, help="training steps")
    draft.add_argument("--max-prompts", type=int, help="prompts used from the set (0: all)")
    draft.add_argument("--max-tokens", type=int, help="tokens generated per answer")
    draft.add_argument("--seed", type=int)


# The trainers import MLX, which must load after platform.setup() (server.cli.main).
def run_assistant(args: argparse.Namespace) -> int:
    from engine.training.assistant import main_cli

    return main_cli(args)


def run_draft(args: argparse.Namespace) -> int:
    from engine.training.draft import main_cli

    return main_cli(args)
