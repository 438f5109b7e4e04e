"""The offline benchmark (tools/benchmark/spec_benchmark.py), one mode per subprocess as it is meant to
run: its JSON validates against the schema and greedy token ids do not depend on speculation."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.models.loader import default_model_folder
from tools.benchmark.schema import validate

REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 24
MODES: dict[str, dict[str, Any] | None] = {
    "baseline": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    # The target as its own draft ("model" filled in by the fixture).
    "draft_model": {"method": "draft_model", "model": "", "num_speculative_tokens": 3},
}
PROMPTS = [
    "Repeat the following text exactly, word for word.\n\nThe meeting on Monday is moved to Tuesday at ten "
    "in the morning. Please bring your reports and the budget figures for the third quarter.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each mode in its own process, one after another: all four at once on two cores ran past a 240 s
    limit in CI (cause not pinned down); one after another the four take ~50 s here."""
    out = tmp_path_factory.mktemp("spec_benchmark")
    docs = {}
    for label, spec in MODES.items():
        cmd = [sys.executable, "-m", "tools.benchmark.spec_benchmark", "--label", label, "--batch-size", "2",
               "--max-tokens", str(MAX_TOKENS), "--repeats", "2", "--warmup", "0", "--ignore-eos",
               "--max-model-len", "1024", "--kv-cache-memory", "256MiB",
               "--output-json", str(out / f"{label}.json")]
        for p in PROMPTS:
            cmd += ["--prompt", p]
        if spec is not None:
            if spec.get("model") == "":
                spec = {**spec, "model": str(default_model_folder())}
            cmd += ["--speculative-config", json.dumps(spec)]
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"{label} failed:\n{proc.stdout[-2000:]}"
        assert "tok/s" in proc.stdout
        docs[label] = json.loads((out / f"{label}.json").read_text())
    return docs


@pytest.mark.parametrize("label", list(MODES))
def test_json_validates_against_schema(results: dict[str, dict[str, Any]], label: str) -> None:
    doc = results[label]
    assert validate(doc) == []
    assert validate(doc, use_jsonschema=False) == []  # the fallback validator agrees
    assert doc["schema_version"] == 1 and doc["label"] == label
    cfg = doc["config"]
    assert (cfg["batch_size"], cfg["max_tokens"], cfg["repeats"]) == (2, MAX_TOKENS, 2)
    assert cfg["ignore_eos"] is True
    assert doc["models"]["target"]["path"] and doc["models"]["target"]["dtype"] == "float32"
    assert doc["runtime"]["blas"]["name"] and doc["runtime"]["packages"]["mlx"]
    assert [p["text"] for p in doc["prompts"]] == PROMPTS
    for run in doc["runs"]:
        assert [len(t) for t in run["token_ids"]] == [MAX_TOKENS, MAX_TOKENS]  # --ignore-eos
        assert run["output_tokens"] == 2 * MAX_TOKENS and run["output_tokens_per_s"] > 0
    assert doc["summary"]["identical_across_repeats"]
    spec = doc["summary"]["spec"]
    if MODES[label] is None:
        assert spec is None and cfg["method"] is None
    else:
        assert cfg["method"] == MODES[label]["method"]
        assert spec["num_draft_tokens"] > 0
        assert spec["num_accepted_tokens"] == sum(spec["accepted_per_position"])
        # Position i+1 can only be accepted when position i was.
        per_pos = spec["accepted_per_position"]
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
        assert len(per_pos) <= MODES[label]["num_speculative_tokens"]
        if label == "draft_model":
            assert doc["models"]["draft"]["same_as_target"]


@pytest.mark.parametrize("label", [m for m in MODES if MODES[m] is not None])
def test_speculation_keeps_greedy_token_ids(results: dict[str, dict[str, Any]], label: str) -> None:
    base = results["baseline"]["runs"][0]["token_ids"]
    for run in results[label]["runs"]:
        assert run["token_ids"] == base


def test_schema_rejects_broken_results(results: dict[str, dict[str, Any]]) -> None:
    doc = copy.deepcopy(results["ngram"])
    doc["runs"][0]["token_ids"][0][0] = -1
    del doc["summary"]["spec"]["accepted_per_position"]
    doc["surprise"] = True
    for use_jsonschema in (True, False):
        errors = validate(doc, use_jsonschema=use_jsonschema)
        assert len(errors) >= 3, errors


def test_summarize_compares_with_the_baseline(results: dict[str, dict[str, Any]], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from tools.benchmark.summarize import main

    paths = []
    for label, doc in results.items():
        paths.append(tmp_path / f"{label}.json")
        paths[-1].write_text(json.dumps(doc))
    assert main([str(p) for p in paths]) == 0  # non-zero would mean token ids differ
    out = capsys.readouterr().out
    assert all(label in out for label in MODES) and "NO" not in out.split()
