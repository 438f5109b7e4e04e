"""Smoke test for `specserve bench engine`: a tiny quick run end to end, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_quick_run_writes_report(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "server.cli", "bench", "engine", "--quick", "--max-tokens", "8",
           "--concurrency", "1,2", "--repeats", "1", "--blas", "auto", "--output-json", str(out)]
    # The worker is a fresh process that chooses its BLAS from this variable; don't inherit a test's.
    env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_BLAS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "specserve tok/s" in proc.stdout

    report = json.loads(out.read_text())
    for key in ("schema_version", "timestamp", "machine", "versions", "model", "config", "workers",
                "medians", "targets"):
        assert key in report, key
    assert set(report["versions"]) == {"mlx", "mlx_lm", "specserve"}
    assert report["model"]["dtype"] == "float32"
    assert report["machine"]["cpu_count"] >= 1

    [worker] = report["workers"]
    assert worker["setting"] == "auto" and worker["blas"]["name"]
    runs = worker["runs"]
    assert {(r["engine"], r["concurrency"]) for r in runs} == {
        (e, c) for e in ("specserve", "mlx_lm") for c in (1, 2)}
    for r in runs:
        assert r["tok_s"] > 0 and r["wall_s"] > 0
        assert r["generated_tokens"] == 8 * r["concurrency"]  # ignore_eos: exactly max_tokens each
    medians = report["medians"]["auto"]
    for c in ("1", "2"):
        assert medians[c]["specserve"] > 0 and medians[c]["mlx_lm"] > 0
    targets = report["targets"]["auto"]
    assert isinstance(targets["single_stream"]["pass"], bool)
    assert targets["aggregate_8"]["pass"] is None  # no concurrency 8 in this run
