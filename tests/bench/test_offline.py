"""`specserve bench offline`: every mode of configs/ through the real engine in one process, interleaved.
Its JSON validates against the schema, greedy token ids do not depend on speculation, and acceptance is
counted per draft position."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from loadtests import modes
from loadtests.schema import validate
from server.cli import main

MAX_TOKENS = 16
PROMPTS = [
    "Repeat the following text exactly, word for word.\n\nThe meeting on Monday is moved to Tuesday at ten "
    "in the morning. Please bring your reports and the budget figures for the third quarter.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every mode (no --modes: off and each config), two interleaved rounds of both prompts at once."""
    tmp = tmp_path_factory.mktemp("offline")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp / "out"
    rc = main(["bench", "offline", "--dataset-path", str(prompts), "--num-prompts", "2",
               "--max-tokens", str(MAX_TOKENS), "--repeats", "2", "--num-warmups", "0", "--ignore-eos",
               "--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--output-dir", str(out)])
    assert rc == 0  # 1 would mean a mode's greedy token ids differ from off's
    docs = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    docs["summary.md"] = {"text": (out / "summary.md").read_text()}
    return docs


@pytest.mark.parametrize("label", modes.available())
def test_json_validates_and_records_the_run(results: dict[str, dict[str, Any]], label: str) -> None:
    doc = results[label]
    assert validate(doc) == []
    assert validate(doc, use_jsonschema=False) == []  # the fallback validator agrees
    assert doc["schema_version"] == 1 and doc["label"] == label
    assert doc["benchmark"] == "specserve.spec_benchmark"
    cfg = doc["config"]
    assert (cfg["batch_size"], cfg["max_tokens"], cfg["repeats"], cfg["warmup"]) == (2, MAX_TOKENS, 2, 0)
    assert cfg["ignore_eos"] is True and doc["warmup_runs"] == []
    assert doc["models"]["target"]["path"] and doc["models"]["target"]["dtype"] == "float32"
    assert doc["runtime"]["blas"]["name"] and doc["runtime"]["packages"]["mlx"]
    assert [p["messages"] for p in doc["prompts"]] == [[{"role": "user", "content": p}] for p in PROMPTS]
    assert [r["repeat"] for r in doc["runs"]] == [0, 1]
    for run in doc["runs"]:
        assert [len(t) for t in run["token_ids"]] == [MAX_TOKENS, MAX_TOKENS]  # --ignore-eos
        assert run["output_tokens"] == 2 * MAX_TOKENS and run["output_tokens_per_s"] > 0
        # Decoding alone: each request's tokens after its first, over first to last token (no prefill).
        for ttft, e2e in zip(run["ttft_s"], run["e2e_s"], strict=True):
            assert 0 < ttft < e2e <= run["elapsed_s"]
        decode_s = sum(e - t for t, e in zip(run["ttft_s"], run["e2e_s"], strict=True))
        assert run["decode_tokens_per_s"] == pytest.approx(2 * (MAX_TOKENS - 1) / decode_s)
    assert doc["summary"]["identical_across_repeats"]
    spec, expected = doc["summary"]["spec"], modes.speculative_config(label)
    if expected is None:
        assert spec is None and cfg["method"] is None and cfg["num_speculative_tokens"] == 0
        return
    assert cfg["method"] == expected["method"] == doc["config"]["speculative_config"]["method"]
    assert spec["num_draft_tokens"] > 0
    assert spec["num_accepted_tokens"] == sum(spec["accepted_per_position"])
    per_pos = spec["accepted_per_position"]  # position i+1 can only be accepted when position i was
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert len(per_pos) <= cfg["num_speculative_tokens"]
    if label == "draft_model":  # configs/draft_model.yaml: the default model drafts for itself
        assert doc["models"]["draft"]["same_as_target"]


@pytest.mark.parametrize("label", [m for m in modes.available() if m != "off"])
def test_speculation_keeps_greedy_token_ids(results: dict[str, dict[str, Any]], label: str) -> None:
    base = results["off"]["runs"][0]["token_ids"]
    for run in results[label]["runs"]:
        assert run["token_ids"] == base


def test_summary_compares_with_off(results: dict[str, dict[str, Any]]) -> None:
    text = results["summary.md"]["text"]
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()[2:]}
    assert set(rows) == set(modes.available())
    assert all(line.rstrip(" |").endswith("yes") for line in rows.values())  # greedy ids = off's


def test_schema_rejects_broken_results(results: dict[str, dict[str, Any]]) -> None:
    doc = copy.deepcopy(results["ngram"])
    doc["runs"][0]["token_ids"][0][0] = -1
    del doc["summary"]["spec"]["accepted_per_position"]
    doc["surprise"] = True
    for use_jsonschema in (True, False):
        errors = validate(doc, use_jsonschema=use_jsonschema)
        assert len(errors) >= 3, errors


def test_k_variants_labelled_configs_and_one_stream(tmp_path: Path) -> None:
    spec = {"method": "suffix", "num_speculative_tokens": 3}
    rc = main(["bench", "offline", "--modes", "off,ngram", "--k", "2", "--speculative-config",
               f"mine={json.dumps(spec)}", "--dataset-name", "chat", "--num-prompts", "2",
               "--max-num-seqs", "1", "--max-tokens", "4", "--repeats", "1", "--num-warmups", "1",
               "--kv-cache-memory", "256MiB", "--output-dir", str(tmp_path)])
    assert rc == 0
    docs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(docs) == {"off", "ngram_k_2", "mine"}
    assert docs["ngram_k_2"]["label"] == "ngram k=2"
    assert docs["ngram_k_2"]["config"]["num_speculative_tokens"] == 2
    assert docs["mine"]["config"]["method"] == "suffix"
    for doc in docs.values():
        assert validate(doc) == []
        assert doc["config"]["batch_size"] == 1 and len(doc["warmup_runs"]) == 1
        assert len(doc["runs"][0]["token_ids"]) == 2


def test_temperature_list_runs_every_mode_at_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "offline", "--modes", "off,ngram", "--temperature", "0,0.8", "--dataset-name", "copy",
               "--num-prompts", "2", "--max-num-seqs", "2", "--max-tokens", "6", "--repeats", "1",
               "--num-warmups", "0", "--kv-cache-memory", "256MiB", "--output-dir", str(tmp_path)])
    assert rc == 0
    docs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert {(d["label"], d["config"]["temperature"]) for d in docs.values()} == {
        ("off", 0.0), ("ngram", 0.0), ("off", 0.8), ("ngram", 0.8)}
    for doc in docs.values():
        assert validate(doc) == []
    table = (tmp_path / "summary.md").read_text()
    assert "| temperature |" in table and "| ngram | 0.8 |" in table
    assert "t=0.8" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--temperature"):
        main(["bench", "offline", "--temperature", "0,-1"])


def test_precisions_run_every_mode_at_each_with_quality(tmp_path: Path) -> None:
    """`--precisions float32,auto`: each (precision, mode) pair measured, each precision's greedy ids equal
    its own off's, and each precision's agreement with float32 recorded (float32 agrees with itself)."""
    rc = main(["bench", "offline", "--modes", "off,ngram", "--precisions", "float32,auto", "--dataset-name",
               "copy", "--num-prompts", "2", "--max-num-seqs", "2", "--max-tokens", "8", "--repeats", "1",
               "--num-warmups", "0", "--kv-cache-memory", "256MiB", "--output-dir", str(tmp_path)])
    assert rc == 0
    docs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert {(d["label"], d["config"]["precision"]) for d in docs.values()} == {
        ("float32 off", "float32"), ("float32 ngram", "float32"), ("auto off", "auto"),
        ("auto ngram", "auto")}
    for doc in docs.values():
        assert validate(doc) == []
    by = {d["label"]: d for d in docs.values()}
    f32, q4 = by["float32 off"]["models"]["target"], by["auto off"]["models"]["target"]
    assert f32["precision"] == "float32" and f32["quality"]["top1_agreement"] == 1.0
    assert q4["quality"]["top1_agreement"] > 0.5 and q4["quality"]["perplexity"] > 1
    assert q4["quality"]["float32_perplexity"] == pytest.approx(f32["quality"]["perplexity"])
    table = (tmp_path / "summary.md").read_text()
    assert "x float32 off" in table and "top-1 agreement with float32" in table
    with pytest.raises(SystemExit, match="--precisions"):
        main(["bench", "offline", "--precisions", "float32,int3"])


def test_digested_results_keep_the_comparisons(results: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    from loadtests.offline import digest_token_ids, token_digest, write

    docs = {label: results[label] for label in ("off", "ngram")}
    write(docs, "table", tmp_path, digest=True)
    for label, doc in docs.items():
        small = json.loads((tmp_path / f"{label}.json").read_text())
        assert validate(small) == [] and validate(small, use_jsonschema=False) == []
        assert "token_ids" not in small["runs"][0] and all("token_ids" not in p for p in small["prompts"])
        assert small["runs"][0]["token_ids_sha256"] == [token_digest(t) for t in doc["runs"][0]["token_ids"]]
        assert len((tmp_path / f"{label}.json").read_text()) < len(json.dumps(doc))
    off, ngram = (json.loads((tmp_path / f"{x}.json").read_text()) for x in ("off", "ngram"))
    assert off["runs"][0]["token_ids_sha256"] == ngram["runs"][0]["token_ids_sha256"]  # greedy: same outputs
    changed = copy.deepcopy(docs["off"])
    changed["runs"][0]["token_ids"][0][-1] += 1
    first = digest_token_ids(changed)["runs"][0]["token_ids_sha256"][0]
    assert first != off["runs"][0]["token_ids_sha256"][0]
    bare = copy.deepcopy(off)
    del bare["runs"][0]["token_ids_sha256"]
    assert any("neither token_ids" in e for e in validate(bare)), validate(bare)


def test_the_schema_names_every_speculative_method() -> None:
    """A method the engine accepts but the schema does not would fail every benchmark run of it."""
    from typing import get_args

    from engine.spec.config import SpeculativeConfig

    union = get_args(get_args(SpeculativeConfig)[0])
    methods = {get_args(m.model_fields["method"].annotation)[0] for m in union}
    schema = json.loads((Path(__file__).parents[2] / "loadtests" / "data" / "spec_benchmark.schema.json")
                        .read_text())
    assert methods | {None} == set(schema["properties"]["config"]["properties"]["method"]["enum"])
