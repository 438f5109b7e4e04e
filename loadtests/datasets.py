"""Datasets for the harness. The built-in sets come from files under loadtests/data/ (all texts were
written for this repository: no downloads, no third-party data):

- chat:       free-text questions (data/chat.jsonl), greedy.
- copy:       summarise / edit / repeat a given text, refactor code (data/passages/*); the answer
              copies much of the prompt, which is where ngram and suffix speculation pay off.
- mixed-temp: chat + copy prompts, a fraction greedy and the rest sampled at temperature 0.7-1.0
              (classes "greedy" and "sampled"): where speculation can hurt the sampled requests' P99.
- extraction-creative: half copy prompts at temperature 0.1 (class "extraction"), half chat prompts at
              1.0 (class "creative"), alternating: an operator's mix, reported per class.
- long:       four to six passages concatenated (~1,000-1,500 tokens) and a question about them.

and two more that need no data:

- random:     prompts of random token ids, exactly `input_len` long, asking for `output_len` tokens
              (sent as token ids to /v1/completions, as vLLM's random dataset measures raw speed).
- custom:     a JSONL file, one request a line: {"messages": [...]} or {"prompt": "..."}, optional
              "max_tokens", "id", "temperature" and "class".

Items may carry a class (`WorkItem.request_class`); results then give latencies and tokens/s per class.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.resources import data

BUILT_IN = ("chat", "copy", "mixed-temp", "extraction-creative", "long")
DATASETS = (*BUILT_IN, "random", "custom")

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
    """One request: chat messages (or, for `random`, prompt token ids), its sampling and length."""

    id: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    temperature: float = 0.0
    max_tokens: int | None = None  # None: the run's --max-tokens
    extra: dict[str, Any] = field(default_factory=dict)
    request_class: str | None = None  # results are also summarised per class

    def prompt_text(self) -> str:
        """The plain-prompt form for /v1/completions."""
        return "\n\n".join(str(m.get("content") or "") for m in self.messages)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def load_passages() -> list[tuple[str, str, str]]:
    """-> [(name, kind "prose" | "code", text)] sorted by name. Code is stored as *.src so that linters
    leave its deliberately unpolished style (the refactoring tasks need something to fix) alone."""
    out = []
    for path in sorted(data("passages").iterdir()):
        if path.suffix in (".txt", ".src"):
            kind = "prose" if path.suffix == ".txt" else "code"
            out.append((path.stem, kind, path.read_text().strip()))
    return out


def chat_items() -> list[WorkItem]:
    items = []
    with open(data("chat.jsonl")) as f:
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


def at_temperature(it: WorkItem, temperature: float, seed: int = 0,
                   request_class: str | None = None) -> WorkItem:
    """A copy of `it` sampled at `temperature`, with a fixed seed per item where it samples: servers
    compared sample from the same key stream, so without speculation (or with lossless speculation on
    one and not the other) their token counts stay comparable. Unseeded, EOS comes at random and moves a
    wave's token count, and so its tokens/s, at the same duration."""
    extra = {k: v for k, v in it.extra.items() if k != "seed"}
    if temperature > 0:
        extra["seed"] = zlib.crc32(f"{seed}:{it.id}".encode())
    return WorkItem(id=it.id, messages=it.messages, prompt_ids=it.prompt_ids, temperature=temperature,
                    max_tokens=it.max_tokens, extra=extra,
                    request_class=it.request_class if request_class is None else request_class)


def mixed_temp_items(greedy_fraction: float = 0.5, seed: int = 0) -> list[WorkItem]:
    rng = random.Random(seed)
    base = chat_items() + copy_items()
    rng.shuffle(base)
    items = []
    for it in base:
        temp = 0.0 if rng.random() < greedy_fraction else round(rng.uniform(0.7, 1.0), 2)
        items.append(at_temperature(it, temp, seed, "greedy" if temp == 0 else "sampled"))
    return items


EXTRACTION_TEMPERATURE = 0.1
CREATIVE_TEMPERATURE = 1.0


def extraction_creative_items(seed: int = 0) -> list[WorkItem]:
    """Copy prompts at 0.1 ("extraction") and chat prompts at 1.0 ("creative"), alternating, so every
    run of consecutive requests is half one class, half the other."""
    rng = random.Random(seed)
    extraction, creative = copy_items(), chat_items()
    rng.shuffle(extraction)
    rng.shuffle(creative)
    items = []
    for ex, cr in zip(extraction, creative, strict=False):  # as many of each: the shorter list's length
        items.append(at_temperature(ex, EXTRACTION_TEMPERATURE, seed, "extraction"))
        items.append(at_temperature(cr, CREATIVE_TEMPERATURE, seed, "creative"))
    return items


def random_items(num: int, input_len: int, output_len: int, vocab_size: int = 32000,
                 seed: int = 0) -> list[WorkItem]:
    """`num` prompts of `input_len` random token ids below `vocab_size`, each asking for `output_len`."""
    rng = random.Random(seed)
    return [WorkItem(id=f"random-{i:04d}", prompt_ids=[rng.randrange(vocab_size) for _ in range(input_len)],
                     max_tokens=output_len) for i in range(num)]


def custom_items(path: str | Path, seed: int = 0) -> list[WorkItem]:
    """A JSONL file of requests: {"messages": [...]} or {"prompt": "..."}, optional "max_tokens", "id",
    "temperature" (sampled ones get a seed per item) and "class"."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "messages" in rec:
            messages = rec["messages"]
        elif "prompt" in rec:
            messages = _user(rec["prompt"])
        else:
            raise ValueError(f"{path}:{n}: a line needs 'messages' or 'prompt'")
        item = WorkItem(id=str(rec.get("id", f"custom-{n}")), messages=messages,
                        max_tokens=rec.get("max_tokens"), request_class=rec.get("class"))
        items.append(at_temperature(item, float(rec.get("temperature", 0.0)), seed))
    if not items:
        raise ValueError(f"{path}: no requests")
    return items


@dataclass(slots=True)
class DatasetOptions:
    """What `load_dataset` needs besides the name (the command-line flags of the same names)."""

    dataset_path: str | None = None
    num_prompts: int = 100  # random only: the others have their own size and are cycled through
    random_input_len: int = 256
    random_output_len: int = 64
    random_vocab_size: int = 32000
    greedy_fraction: float = 0.5
    seed: int = 0


def load_dataset(name: str, opts: DatasetOptions | None = None) -> list[WorkItem]:
    """The items of one dataset, in a fixed (seeded) order."""
    opts = opts or DatasetOptions()
    if name == "chat":
        return chat_items()
    if name == "copy":
        items = copy_items()
        random.Random(opts.seed).shuffle(items)  # interleave prose and code
        return items
    if name == "mixed-temp":
        return mixed_temp_items(opts.greedy_fraction, opts.seed)
    if name == "extraction-creative":
        return extraction_creative_items(opts.seed)
    if name == "long":
        return long_items(opts.seed)
    if name == "random":
        return random_items(opts.num_prompts, opts.random_input_len, opts.random_output_len,
                            opts.random_vocab_size, opts.seed)
    if name == "custom":
        if not opts.dataset_path:
            raise ValueError("dataset 'custom' needs --dataset-path FILE.jsonl")
        return custom_items(opts.dataset_path, opts.seed)
    raise ValueError(f"unknown dataset {name!r} (one of {', '.join(DATASETS)})")
