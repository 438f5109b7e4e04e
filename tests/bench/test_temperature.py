"""`bench sweep --temperatures` and per-class reporting: the temperature axis, the extraction-creative
workload, per-class percentiles and the tables, on plain data; then end to end against real in-process
servers (default model, two prompts, a few tokens)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from loadtests.client import RequestOptions, build_payload
from loadtests.datasets import (
    CREATIVE_TEMPERATURE,
    EXTRACTION_TEMPERATURE,
    DatasetOptions,
    at_temperature,
    load_dataset,
)
from loadtests.plots import PNG_SIGNATURE, plot_by_dataset
from loadtests.prom import SpecCounters, acceptance_summary
from loadtests.report import load_key
from loadtests.runner import Level, summarize
from loadtests.sweep import levels_of, markdown, ratios
from server.cli import main

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def test_levels_carry_a_temperature() -> None:
    levels = levels_of([math.inf], [1, 8], [0.0, 0.5])
    assert [lv.key for lv in levels] == ["c1-t0", "c1-t0.5", "c8-t0", "c8-t0.5"]  # temperature innermost
    assert [lv.load_key for lv in levels] == ["c1", "c1", "c8", "c8"]
    assert [lv.key for lv in levels_of([2.0], [None])] == ["r2"]  # no axis: keys as before
    js = Level(request_rate=2.5, max_concurrency=4, temperature=1.0).to_json()
    assert js == {"level": "r2.5-c4-t1", "request_rate": 2.5, "max_concurrency": 4, "temperature": 1.0}
    assert load_key(js) == "r2.5-c4" and load_key(Level(max_concurrency=8).to_json()) == "c8"


def test_items_at_a_temperature_are_seeded_per_prompt() -> None:
    copy = load_dataset("copy")
    hot = [at_temperature(it, 0.8, seed=3) for it in copy]
    assert {it.temperature for it in hot} == {0.8} and [it.id for it in hot] == [it.id for it in copy]
    seeds = [it.extra["seed"] for it in hot]
    assert len(set(seeds)) == len(seeds)  # one per prompt ...
    assert seeds == [at_temperature(it, 0.4, seed=3).extra["seed"] for it in copy]  # ... at any temperature
    assert seeds != [at_temperature(it, 0.8, seed=4).extra["seed"] for it in copy]
    assert "seed" not in at_temperature(hot[0], 0.0).extra  # greedy needs none
    _, body = build_payload(hot[0], RequestOptions())
    assert body["temperature"] == 0.8 and body["seed"] == seeds[0]


def test_extraction_creative_alternates_two_classes() -> None:
    items = load_dataset("extraction-creative", DatasetOptions(seed=1))
    classes = [it.request_class for it in items]
    assert classes[:4] == ["extraction", "creative", "extraction", "creative"]
    assert classes.count("extraction") == classes.count("creative") == len(items) // 2 >= 16
    for it in items:
        extraction = it.request_class == "extraction"
        assert it.id.startswith("copy-" if extraction else "chat-")  # copy-heavy vs free text
        assert it.temperature == (EXTRACTION_TEMPERATURE if extraction else CREATIVE_TEMPERATURE)
        assert isinstance(it.extra["seed"], int)
    again = load_dataset("extraction-creative", DatasetOptions(seed=1))
    assert [(it.id, it.extra["seed"]) for it in again] == [(it.id, it.extra["seed"]) for it in items]
    # mixed-temp's split is a class like any other
    assert all(it.request_class == ("greedy" if it.temperature == 0 else "sampled")
               for it in load_dataset("mixed-temp"))


def _record(cls: str | None, ttft: float, tpot: float, tokens: int, ok: bool = True,
            temperature: float = 0.0) -> dict[str, Any]:
    e2e = ttft + tpot * (tokens - 1)
    return {"item_id": "x", "temperature": temperature, "start": 0.0, "ok": ok,
            "error": None if ok else "boom", "ttft": ttft if ok else None, "e2e": e2e if ok else None,
            "itl": [], "prompt_tokens": 10, "output_tokens": tokens if ok else 0, "chunks": tokens,
            "usage_reported": True, "finish_reason": "length", "retries": 0, "tpot": tpot if ok else None,
            "request_class": cls}


def test_per_class_percentiles_from_known_latencies() -> None:
    # class a: TTFT 0.1 .. 1.0 s, TPOT 10 ms, 11 tokens; class b: TTFT 50 ms, TPOT 20 / 40 ms; one failed
    # request of class a and one without a class.
    records = [_record("a", 0.1 * i, 0.010, 11) for i in range(1, 11)]
    records += [_record("b", 0.05, 0.020, 5), _record("b", 0.05, 0.040, 5), _record("a", 0, 0, 0, ok=False),
                _record(None, 2.0, 0.5, 3)]
    s = summarize(records, duration=4.0)
    assert s["completed"] == 13 and s["output_tokens"] == 110 + 10 + 3
    a, b = s["classes"]["a"], s["classes"]["b"]
    assert set(s["classes"]) == {"a", "b"}  # the unclassed request counts in the totals only
    assert (a["num_requests"], a["completed"], a["failed"], a["output_tokens"]) == (11, 10, 1, 110)
    assert a["output_throughput_tok_s"] == pytest.approx(110 / 4.0)  # over the level's whole duration
    assert a["ttft_ms"]["p50"] == pytest.approx(550.0)
    assert a["ttft_ms"]["p99"] == pytest.approx(991.0)  # 900 + 0.91 x 100
    assert a["tpot_ms"]["p50"] == pytest.approx(10.0) and a["tpot_ms"]["p99"] == pytest.approx(10.0)
    assert a["e2e_ms"]["p50"] == pytest.approx(650.0) and a["e2e_ms"]["p99"] == pytest.approx(1091.0)
    assert b["tpot_ms"]["p50"] == pytest.approx(30.0) and b["tpot_ms"]["p99"] == pytest.approx(39.8)
    assert b["output_throughput_tok_s"] == pytest.approx(10 / 4.0)
    assert "classes" not in summarize([_record(None, 0.1, 0.01, 3)], 1.0)


def _level(temperature: float, extraction_tokens: int, tpot: float, spec: SpecCounters | None,
           ) -> dict[str, Any]:
    records = [_record("extraction", ttft, tpot, extraction_tokens, temperature=temperature)
               for ttft in (0.1, 0.3)]
    records += [_record("creative", 0.2, 0.021, 20, temperature=temperature) for _ in range(2)]
    s = summarize(records, duration=2.0)
    return {**Level(max_concurrency=4, temperature=temperature).to_json(), **s,
            "spec_decode": acceptance_summary(spec), "round_throughput_tok_s": [s["output_throughput_tok_s"]]}


@pytest.fixture
def temperature_doc() -> dict[str, Any]:
    """off and ngram at c4, temperatures 0 and 1: at 0 ngram drafts 40 tokens, accepts 30, and makes the
    extraction class faster (50 tokens at 5 ms instead of 40 at 10 ms); at 1 it drafts nothing."""
    drafted = SpecCounters(drafts=10, draft_tokens=40, accepted=30, per_pos={0: 10.0, 1: 9.0, 2: 7.0, 3: 4.0})
    runs = [{"label": "off", "dataset": "mix", "levels": [_level(0.0, 40, 0.010, None),
                                                          _level(1.0, 40, 0.010, None)]},
            {"label": "ngram", "dataset": "mix", "levels": [_level(0.0, 50, 0.005, drafted),
                                                            _level(1.0, 40, 0.010, SpecCounters())]}]
    return {"created": "now", "environment": {"platform": "test", "cpu_count": 2}, "base": "off",
            "config": {"datasets": ["mix"], "levels": ["c4-t0", "c4-t1"], "rounds": 1,
                       "request": {"max_tokens": 64}},
            "runs": runs, "ratios": ratios(runs, "off")}


def test_ratios_and_tables_per_temperature_and_class(temperature_doc: dict[str, Any], tmp_path: Path) -> None:
    rows = {(r["level"], r["label"]): r for r in temperature_doc["ratios"]}
    assert rows[("c4-t0", "ngram")]["vs_base"] == pytest.approx(70 / 60)
    assert rows[("c4-t0", "ngram")]["classes_vs_base"] == pytest.approx({"extraction": 1.25, "creative": 1.0})
    assert rows[("c4-t1", "ngram")]["classes_vs_base"] == pytest.approx({"extraction": 1.0, "creative": 1.0})
    assert rows[("c4-t0", "off")]["classes_vs_base"] == {}
    md = markdown(temperature_doc)
    assert "| level | temp | server | ok/n | tok/s | x off |" in md
    # level, temp, server, ok/n, tok/s, x off, x best other, per round, TTFT p50/p99, TPOT p50/p99, e2e p99,
    # drafted, acceptance rate and length
    assert ("| c4 | 0 | ngram | 4/4 | 70.0 | 1.17 | 1.17 | 1.17 | 200 | 297 | 13 | 21 | 599 | 40 | 0.75 | "
            "4.00 |") in md
    assert "| c4 | 1 | ngram | 4/4 | 60.0 | 1.00 |" in md and "| 0 | - | - |" in md  # drafted nothing
    assert "| c4 | 0 | off | 4/4 | 60.0 | - |" in md
    # per class: TTFT 100 / 300 ms -> p50 200, p99 298; e2e = TTFT + TPOT x 49 (or 39)
    assert "| level | temp | class | server | ok/n | tok/s | x off |" in md
    assert "| c4 | 0 | extraction | off | 2/2 | 40.0 | - | 200 | 298 | 10 | 10 | 590 | 688 |" in md
    assert "| c4 | 0 | extraction | ngram | 2/2 | 50.0 | 1.25 | 200 | 298 | 5 | 5 | 445 | 543 |" in md
    assert "| c4 | 1 | creative | ngram | 2/2 | 20.0 | 1.00 | 200 | 200 | 21 | 21 | 599 | 599 |" in md
    # one load level: the temperature plot only
    pngs = plot_by_dataset(temperature_doc["runs"], tmp_path, base="off")
    assert pngs == [tmp_path / "mix-temperature.png"]
    assert (tmp_path / "mix-temperature.png").read_bytes()[:8] == PNG_SIGNATURE


def test_datasets_with_their_own_temperatures_are_refused(tmp_path: Path) -> None:
    for ds in ("mixed-temp", "extraction-creative"):
        with pytest.raises(SystemExit, match=f"{ds} set their own temperatures"):
            main(["bench", "sweep", "--server", "off=http://127.0.0.1:9", "--temperatures", "0,1",
                  "--dataset-name", ds, "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="not both"):
        main(["bench", "sweep", "--server", "off=http://127.0.0.1:9", "--temperatures", "0,1",
              "--temperature", "0.5", "--output-dir", str(tmp_path)])


def test_temperature_sweep_end_to_end(make_server: Any, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    with make_server() as off, make_server(speculative_config=NGRAM) as ngram:
        # off listed second: the ratios still divide by it
        rc = main(["bench", "sweep", "--server", f"ngram={ngram.url}", "--server", f"off={off.url}",
                   "--temperatures", "0,1", "--dataset-name", "copy", "--max-concurrency", "2",
                   "--num-prompts", "2", "--max-tokens", "8", "--num-warmups", "0", "--save-detailed",
                   "--output-dir", str(out)])
        assert rc == 0 and off.idle() and ngram.idle()
    log = capsys.readouterr().out
    order = [line.split("]")[0].strip(" [") for line in log.splitlines() if line.startswith("  [copy")]
    assert order == ["copy c2-t0 r0"] * 2 + ["copy c2-t1 r0"] * 2
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["base"] == "off" and doc["config"]["levels"] == ["c2-t0", "c2-t1"]
    assert doc["config"]["temperatures"] == [0.0, 1.0]
    by = {r["label"]: r for r in doc["runs"]}
    prompts = []
    for run in by.values():
        for lvl, temp in zip(run["levels"], (0.0, 1.0), strict=True):
            assert lvl["temperature"] == temp and lvl["completed"] == lvl["num_requests"] == 2
            assert {r["temperature"] for r in lvl["requests"]} == {temp}
            prompts.append([r["item_id"] for r in lvl["requests"]])
    assert all(p == prompts[0] for p in prompts)  # same prompts on every server and at every temperature
    assert by["off"]["levels"][1]["spec_decode"] is None
    assert by["ngram"]["levels"][0]["spec_decode"]["num_draft_tokens"] > 0
    sampled = by["ngram"]["levels"][1]["spec_decode"]  # counted at t=1 too (8 tokens: maybe no match)
    assert sampled is not None
    assert sampled["acceptance_rate"] is None or 0 <= sampled["acceptance_rate"] <= 1
    md = (out / "results.md").read_text()
    assert "| c2 | 0 | ngram | 2/2 |" in md and "| c2 | 1 | off | 2/2 |" in md and "x off" in md
    assert (out / "copy-temperature.png").read_bytes()[:8] == PNG_SIGNATURE
    assert not (out / "copy.png").exists()


def test_mixed_classes_end_to_end(make_server: Any, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    with make_server() as off, make_server(speculative_config=NGRAM) as ngram:
        rc = main(["bench", "sweep", "--server", f"off={off.url}", "--server", f"ngram={ngram.url}",
                   "--dataset-name", "extraction-creative", "--max-concurrency", "4", "--num-prompts", "4",
                   "--max-tokens", "8", "--num-warmups", "0", "--save-detailed", "--output-dir", str(out)])
        assert rc == 0 and off.idle() and ngram.idle()
    doc = json.loads((out / "sweep.json").read_text())
    for run in doc["runs"]:
        (lvl,) = run["levels"]
        assert {r["request_class"]: r["temperature"] for r in lvl["requests"]} == {
            "extraction": EXTRACTION_TEMPERATURE, "creative": CREATIVE_TEMPERATURE}
        classes = lvl["classes"]
        assert sorted(classes) == ["creative", "extraction"]
        assert [classes[c]["completed"] for c in sorted(classes)] == [2, 2]
        assert sum(c["output_tokens"] for c in classes.values()) == lvl["output_tokens"]
        for c in classes.values():
            for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
                assert c[key]["p50"] is not None and c[key]["p50"] <= c[key]["p99"]
    md = (out / "results.md").read_text()
    assert "Per class (`extraction-creative`)" in md
    assert "| c4 | extraction | ngram | 2/2 |" in md and "| c4 | creative | off | 2/2 |" in md
    # `bench serve` prints the classes too
    capsys.readouterr()
    with make_server() as srv:
        assert main(["bench", "serve", "--base-url", srv.url, "--dataset-name", "extraction-creative",
                     "--num-prompts", "2", "--max-tokens", "4", "--num-warmups", "0", "--disable-tqdm"]) == 0
    printed = capsys.readouterr().out
    assert "Class creative" in printed and "Class extraction" in printed and "P99 E2EL (ms):" in printed
