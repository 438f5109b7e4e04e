"""Workloads shipped with the load generator: every prompt comes from files under loadtests/data/.

- chat:       free-text questions (data/chat.jsonl), greedy.
- copy:       summarise / edit / repeat a given text, refactor code (data/passages/*); the answer
              copies much of the prompt, which is where ngram and suffix speculation pay off.
- mixed-temp: chat + copy prompts, a fraction greedy and the rest sampled at temperature 0.7-1.0;
              sampled requests skip drafting, so this is the case where speculation can hurt P99.
- long:       four to six passages concatenated (~1,000-1,500 tokens) and a question about them.

All texts were written for this repository (no downloads, no third-party data).
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

DATA_DIR = Path(str(files(__package__).joinpath("data")))
WORKLOADS = ("chat", "copy", "mixed-temp", "long")

_PROSE_TASKS = [
    "Repeat the following text exactly, word for word.",
    "Correct any spelling or grammar mistakes in the following text and return the full corrected text.",
    "Rewrite the following text in the past tense, keeping every sentence in the same order.",
    "Summarise the following text in three sentences.",
    "Rewrite the following text, replacing every number written in words with digits.",
]
_CODE_TASKS = [
    "Refactor the following code: add type hints and docstrings, keep the behaviour the same, and "
    "return the full code.",
    "Rewrite the following code with clearer variable names. Return the full code and nothing else.",
    "Add a short comment above every function in the following code and return the full code.",
    "Repeat the following code exactly, then explain in one sentence what it does.",
]
_LONG_QUESTIONS = [
    "Summarise each of the documents above in one sentence.",
    "Which of the documents above mention a date or a day of the week? Quote the relevant sentences.",
    "List every number that appears in the documents above, with the document it comes from.",
    "Which document above would be most useful to a tourist, and why?",
]


@dataclass(slots=True)
class WorkItem:
    """One request of a workload: the chat messages (or a plain prompt) and its sampling."""

    id: str
    messages: list[dict[str, str]]
    temperature: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def prompt_text(self) -> str:
        """The plain-prompt form for /v1/completions."""
        return "\n\n".join(m["content"] for m in self.messages)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def load_passages() -> list[tuple[str, str, str]]:
    """-> [(name, kind "prose" | "code", text)] sorted by name. Code is stored as *.src so that linters
    leave its deliberately unpolished style (the refactoring tasks need something to fix) alone."""
    out = []
    for path in sorted((DATA_DIR / "passages").iterdir()):
        if path.suffix in (".txt", ".src"):
            kind = "prose" if path.suffix == ".txt" else "code"
            out.append((path.stem, kind, path.read_text().strip()))
    return out


def chat_items() -> list[WorkItem]:
    items = []
    with open(DATA_DIR / "chat.jsonl") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                items.append(WorkItem(id=rec["id"], messages=_user(rec["prompt"])))
    return items


def copy_items() -> list[WorkItem]:
    items = []
    for i, (name, kind, text) in enumerate(load_passages()):
        tasks = _PROSE_TASKS if kind == "prose" else _CODE_TASKS
        for j in range(2):  # two tasks per passage, rotating so every task is used
            task = tasks[(i + j) % len(tasks)]
            fence = "```" if kind == "code" else ""
            body = f"{fence}\n{text}\n{fence}" if fence else text
            items.append(WorkItem(id=f"copy-{name}-{j}", messages=_user(f"{task}\n\n{body}")))
    return items


def long_items(seed: int = 0) -> list[WorkItem]:
    prose = [(n, t) for n, k, t in load_passages() if k == "prose"]
    rng = random.Random(seed)
    items = []
    for i in range(12):
        docs = rng.sample(prose, rng.randint(4, 6))
        parts = [f"Document {d + 1} ({name}):\n{text}" for d, (name, text) in enumerate(docs)]
        question = _LONG_QUESTIONS[i % len(_LONG_QUESTIONS)]
        items.append(WorkItem(id=f"long-{i:02d}", messages=_user("\n\n".join(parts) + "\n\n" + question)))
    return items


def mixed_temp_items(greedy_fraction: float = 0.5, seed: int = 0) -> list[WorkItem]:
    rng = random.Random(seed)
    base = chat_items() + copy_items()
    rng.shuffle(base)
    items = []
    for it in base:
        temp = 0.0 if rng.random() < greedy_fraction else round(rng.uniform(0.7, 1.0), 2)
        # A fixed seed per sampled item: every server compared samples the same text (speculation never
        # touches sampled requests), so their token counts match. Unseeded, EOS came at random and one
        # wave of 8 moved by 9% in tokens (468-512) at the same duration.
        extra = {"seed": zlib.crc32(f"{seed}:{it.id}".encode())} if temp > 0 else {}
        items.append(WorkItem(id=it.id, messages=it.messages, temperature=temp, extra=extra))
    return items


def load_workload(name: str, seed: int = 0, greedy_fraction: float = 0.5) -> list[WorkItem]:
    """The items of one workload, in a fixed (seeded) order."""
    if name == "chat":
        return chat_items()
    if name == "copy":
        items = copy_items()
        random.Random(seed).shuffle(items)  # interleave prose and code
        return items
    if name == "mixed-temp":
        return mixed_temp_items(greedy_fraction, seed)
    if name == "long":
        return long_items(seed)
    raise ValueError(f"unknown workload {name!r} (one of {', '.join(WORKLOADS)})")
