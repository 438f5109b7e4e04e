"""`specserve bench serve` against real in-process servers (real engine, default model), plus its pure
parts: /metrics parsing, percentiles, datasets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtests.datasets import BUILT_IN, DatasetOptions, load_dataset
from loadtests.plots import PNG_SIGNATURE
from loadtests.prom import SpecCounters, acceptance_summary, merge_spec, parse_spec_counters
from loadtests.runner import percentile
from server.cli import main

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
DIST_KEYS = {"mean", "p50", "p90", "p99"}

METRICS_TEXT = """\
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 2.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 99.0
"""


def test_parse_and_diff_spec_counters() -> None:
    after = parse_spec_counters(METRICS_TEXT)
    assert after is not None and after.per_pos == {0: 10.0, 1: 8.0, 2: 5.0, 3: 2.0}
    before = SpecCounters(drafts=4, draft_tokens=16, accepted=10, per_pos={0: 4, 1: 3, 2: 2, 3: 1})
    s = acceptance_summary(after.minus(before))
    assert s is not None
    assert (s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (6, 24, 15)
    assert s["acceptance_rate"] == pytest.approx(15 / 24)
    assert s["mean_acceptance_length"] == pytest.approx(1 + 15 / 6)
    assert s["accepted_per_position"] == [6, 5, 3, 1]
    assert merge_spec([s, s])["acceptance_rate"] == pytest.approx(15 / 24)
    assert parse_spec_counters('vllm:generation_tokens_total{model_name="m"} 1.0\n') is None


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_datasets(tmp_path: Path) -> None:
    for name in BUILT_IN:
        items = load_dataset(name)
        assert len(items) >= 12, name
        assert all(it.messages and it.messages[0]["content"].strip() for it in items)
    mixed = load_dataset("mixed-temp")
    temps = [it.temperature for it in mixed]
    assert 0.0 in temps and all(t == 0 or 0.7 <= t <= 1.0 for t in temps)
    assert any(t > 0 for t in temps)
    # Sampled items carry a seed, the same on every load (servers compared sample the same text).
    seeds = [it.extra.get("seed") for it in mixed if it.temperature > 0]
    assert None not in seeds and len(set(seeds)) == len(seeds)
    assert seeds == [it.extra["seed"] for it in load_dataset("mixed-temp") if it.temperature > 0]
    assert all("seed" not in it.extra for it in mixed if it.temperature == 0)
    assert min(len(it.messages[0]["content"]) for it in load_dataset("long")) > 3000
    assert [it.id for it in load_dataset("copy")] == [it.id for it in load_dataset("copy")]  # seeded order
    rand = load_dataset("random", DatasetOptions(num_prompts=3, random_input_len=7, random_output_len=5,
                                                 random_vocab_size=100))
    assert [len(it.prompt_ids or []) for it in rand] == [7, 7, 7] and {it.max_tokens for it in rand} == {5}
    assert all(0 <= t < 100 for it in rand for t in it.prompt_ids or [])
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n\n'
                    '{"prompt": "yo", "max_tokens": 3}\n')
    a, b = load_dataset("custom", DatasetOptions(dataset_path=str(path)))
    assert a.messages == [{"role": "user", "content": "hi"}] and a.max_tokens is None
    assert b.messages == [{"role": "user", "content": "yo"}] and b.max_tokens == 3
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="'messages' or 'prompt'"):
        load_dataset("custom", DatasetOptions(dataset_path=str(path)))


def _serve(url: str, tmp_path: Path, name: str, *flags: str) -> tuple[int, dict[str, Any]]:
    rc = main(["bench", "serve", "--base-url", url, "--disable-tqdm", "--num-warmups", "0", "--save-result",
               "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", name, *flags])
    path = tmp_path / f"{name}.json"
    return rc, json.loads(path.read_text()) if path.exists() else {}


def test_serve_measures_latencies_and_acceptance(make_server: Any, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for label, spec in (("off", None), ("ngram", NGRAM)):
        with make_server(speculative_config=spec) as srv:
            rc, doc = _serve(srv.base_url, tmp_path, label, "--dataset-name", "copy",
                             "--max-concurrency", "2", "--num-prompts", "5", "--max-tokens", "16", "--plot")
            assert rc == 0 and srv.idle()
            model = srv.client.model_name
        out = capsys.readouterr().out
        assert "Serving Benchmark Result" in out and "Median TPOT (ms):" in out
        assert ("Speculative Decoding" in out) == (spec is not None)
        assert (tmp_path / f"{label}.png").read_bytes()[:8] == PNG_SIGNATURE
        assert doc["schema"] == "specserve-bench/1" and doc["kind"] == "serve"
        assert doc["config"]["model"] == model  # asked /v1/models, as vLLM's client does
        (run,) = doc["runs"]
        assert run["label"] == model and run["dataset"] == "copy"
        (lvl,) = run["levels"]
        assert (lvl["level"], lvl["request_rate"], lvl["max_concurrency"]) == ("c2", None, 2)
        assert lvl["num_requests"] == lvl["completed"] == 5 and lvl["failed"] == 0
        assert lvl["output_tokens"] > 0 and lvl["output_throughput_tok_s"] > 0 and lvl["input_tokens"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(lvl[key]) == DIST_KEYS and lvl[key]["p50"] is not None, key
            assert lvl[key]["p50"] <= lvl[key]["p90"] <= lvl[key]["p99"]
        assert lvl["ttft_ms"]["p99"] <= lvl["e2e_ms"]["p99"]
        for r in lvl["requests"]:
            assert r["ok"] and r["usage_reported"] and 0 < r["output_tokens"] <= 16
            assert r["ttft"] <= r["e2e"] and len(r["itl"]) == r["chunks"] - 1
        if spec is None:
            assert lvl["spec_decode"] is None
        else:
            acc = lvl["spec_decode"]
            assert acc["num_draft_tokens"] > 0 and 0 <= acc["acceptance_rate"] <= 1
            assert len(acc["accepted_per_position"]) <= 4 and acc["mean_acceptance_length"] >= 1


def test_poisson_rate_stops_at_the_time_bound(server: Any, tmp_path: Path) -> None:
    rc, doc = _serve(server.url, tmp_path, "rate", "--dataset-name", "chat", "--request-rate", "4",
                     "--num-prompts", "50", "--duration", "1.5", "--max-tokens", "4")
    assert rc == 0 and server.idle()
    (lvl,) = doc["runs"][0]["levels"]
    assert lvl["request_rate"] == 4 and lvl["max_concurrency"] is None and lvl["level"] == "r4"
    assert 1 <= lvl["num_requests"] < 50 and lvl["failed"] == 0  # the 1.5 s bound, not the count, ended it
    starts = [r["start"] for r in lvl["requests"]]
    assert max(starts) < 1.5


def test_random_dataset_has_exact_lengths(server: Any, tmp_path: Path) -> None:
    rc, doc = _serve(server.url, tmp_path, "random", "--dataset-name", "random", "--random-input-len", "12",
                     "--random-output-len", "5", "--ignore-eos", "--num-prompts", "3",
                     "--max-concurrency", "3")
    assert rc == 0 and server.idle()
    (lvl,) = doc["runs"][0]["levels"]
    assert doc["config"]["request"]["endpoint"] == "/v1/completions"  # token ids need it
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in lvl["requests"]] == [(12, 5)] * 3


def test_custom_jsonl_of_chats(server: Any, tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    path.write_text(json.dumps({"id": "a", "messages": chat}) + "\n"
                    + json.dumps({"id": "b", "prompt": "Count to ten.", "max_tokens": 3}) + "\n")
    rc, doc = _serve(server.url, tmp_path, "custom", "--dataset-path", str(path), "--num-prompts", "4",
                     "--max-tokens", "6", "--max-concurrency", "1")
    assert rc == 0 and server.idle()
    assert doc["runs"][0]["dataset"] == "custom"  # --dataset-path alone picks it
    reqs = doc["runs"][0]["levels"][0]["requests"]
    assert [r["item_id"] for r in reqs] == ["a", "b", "a", "b"]
    assert all(r["output_tokens"] <= (3 if r["item_id"] == "b" else 6) for r in reqs)


def test_unreachable_server_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, doc = _serve(f"http://127.0.0.1:{port}", tmp_path, "down", "--num-prompts", "1", "--max-tokens", "2")
    assert rc == 1
    (lvl,) = doc["runs"][0]["levels"]
    assert lvl["completed"] == 0 and lvl["failed"] == 1 and lvl["errors"]
    assert "Failed requests:" in capsys.readouterr().out
