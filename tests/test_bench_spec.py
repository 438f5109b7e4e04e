"""tools/bench_spec: a tiny run of the sustained-concurrency workload writes its JSON, and speculation's
greedy output equals plain decoding's in it."""

from __future__ import annotations

import json
from pathlib import Path

from tools import bench_spec


def test_conc8_runs_and_records_identical_greedy_output(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench_spec.main(["--workloads", "conc8", "--modes", "off,ngram", "--repeats", "1",
                            "--max-tokens", "6", "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    runs = data["runs"]["conc8"]
    assert [len(r["token_ids"]) for r in runs["off"]] == [24]  # 8 in flight, 24 requests in all
    assert runs["ngram"][0]["token_ids"] == runs["off"][0]["token_ids"]
    assert data["summary"]["conc8"]["ngram"]["greedy_identical"] is True
    assert "conc8_best_spec_vs_off" in data["checks"]
