"""The committed training prompt set is what `engine/training/prompts.py` builds, and it never contains a
held-out (benchmark) prompt: the MTP benchmark's acceptance is measured on prompts the assistant never saw."""

from __future__ import annotations

from engine.training.assistant import read_prompts
from engine.training.prompts import ROOT, build


def test_committed_prompt_file_is_the_tools_output() -> None:
    built = build()
    assert built == build()  # deterministic
    assert read_prompts(ROOT / "configs" / "train_prompts.jsonl") == built


def test_no_held_out_prompt_and_no_duplicates() -> None:
    built = build()
    held = read_prompts(ROOT / "configs" / "train_prompts_heldout.jsonl")
    assert held and not set(held) & set(built)
    assert len(set(built)) == len(built)
