"""`specserve train-assistant`, `train-eagle3` and `train-draft`: the command lines of engine/training/."""

from __future__ import annotations

import argparse
from typing import Any


def _common(p: argparse.ArgumentParser, out_help: str) -> None:
    """The flags every trainer takes: the target, where results go, the prompts, steps and seed."""
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--prompts", default=None, help="JSONL of {\"prompt\": ...} (default: configs/)")
    p.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--seed", type=int)


def _init(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--init", default=None,
                   help=f"start from this trained {what} (its vocabulary kept) with a fresh optimizer and "
                        "schedule, e.g. to train a shipped one on more data")


def add_parsers(sub: Any) -> None:
    # Numeric training flags default to None: the defaults live in TrainSettings / Eagle3Settings /
    # DraftSettings.
    train = sub.add_parser("train-assistant", help="self-distil an MTP assistant for MODEL (method: mtp)",
                           description="The target writes its own training text, then a small assistant "
                                       "learns its next-next token on MLX. Resumable: rerun to continue.")
    _common(train, "output folder (checkpoint/ and data/ go inside)")
    train.add_argument("--max-prompts", type=int, help="prompts used from the set (0: all)")
    train.add_argument("--mix-sampled", action="store_true",
                       help="answer odd prompts with sampling (default: greedy only, as drafting sees)")
    train.add_argument("--head-size", type=int, help="reduced vocabulary of the head")
    train.add_argument("--intermediate-size", type=int,
                       help="MLP width of the assistant's layer (default: a sixth of the target's)")
    train.add_argument("--max-tokens", type=int, help="tokens generated per answer")
    train.add_argument("--answer-only", action="store_true",
                       help="score answer positions only (default: every position)")
    _init(train, "assistant")
    eagle = sub.add_parser("train-eagle3", help="train an EAGLE-3 draft head for MODEL (method: eagle3)",
                           description="The target writes its own training text, then a one-layer EAGLE-3 "
                                       "head learns to draft from the target's features with training-time "
                                       "test, saved in the speculators layout. Rerun with --resume to "
                                       "continue.")
    _common(eagle, "output folder (checkpoint/ and data/ go inside)")
    eagle.add_argument("--heldout", default=None,
                       help="JSONL of held-out prompts for the top-1 figures (default: configs/; '': none)")
    eagle.add_argument("--max-sequences", type=int, help="training prompts used, one answer each (0: all)")
    eagle.add_argument("--max-new-tokens", type=int, help="tokens the target writes per answer")
    eagle.add_argument("--draft-vocab-size", type=int,
                       help="the head's vocabulary: the most frequent answer tokens")
    eagle.add_argument("--batch-size", type=int, help="sequences per step")
    eagle.add_argument("--lr", type=float, help="peak learning rate (AdamW, warm-up then cosine decay)")
    eagle.add_argument("--ttt-steps", type=int, help="training-time-test steps (draft positions trained)")
    eagle.add_argument("--intermediate-size", type=int,
                       help="the head's MLP width (default: the target's; with --init, its strongest neurons "
                            "are kept)")
    eagle.add_argument("--aux-layers", default=None,
                       help="the 3 target layers whose inputs the head reads, e.g. 2,15,27 (default: "
                            "(2, L // 2, L - 3) for L layers, as vLLM and speculators)")
    eagle.add_argument("--resume", action="store_true", help="continue OUT/checkpoint")
    _init(eagle, "head")
    draft = sub.add_parser("train-draft", help="distil a small draft model for MODEL (method: draft_model)",
                           description="The target's first layers, trained on the text the target writes "
                                       "itself. Resumable: rerun to continue.")
    _common(draft, "output folder (a Hugging Face-layout model)")
    draft.add_argument("--data", default=None,
                       help="reuse generated text: a sequences.jsonl written by train-assistant/train-draft")
    draft.add_argument("--num-layers", type=int, help="target layers the draft keeps")
    draft.add_argument("--max-prompts", type=int, help="prompts used from the set (0: all)")
    draft.add_argument("--max-tokens", type=int, help="tokens generated per answer")


# The trainers import MLX, which must load after platform.setup() (server.cli.main).
def run_assistant(args: argparse.Namespace) -> int:
    from engine.training.assistant import main_cli

    return main_cli(args)


def run_eagle3(args: argparse.Namespace) -> int:
    from engine.training.eagle3 import main_cli

    return main_cli(args)


def run_draft(args: argparse.Namespace) -> int:
    from engine.training.draft import main_cli

    return main_cli(args)
