"""results/ holds current headline results only: small enough to clone, and every `bench offline` result in
it still valid against the schema its command writes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from loadtests.schema import validate

RESULTS = Path(__file__).resolve().parents[2] / "results"
LIMIT = 3 * 1024 * 1024


def _committed() -> list[Path]:
    """What git tracks under results/ (ignored logs and scratch runs of this checkout do not count)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "results"], cwd=RESULTS.parent, capture_output=True,
                             check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        return [p for p in RESULTS.rglob("*") if p.is_file()]
    return [RESULTS.parent / name for name in out.split("\0") if name and (RESULTS.parent / name).is_file()]


def test_results_stay_under_the_bound() -> None:
    files = _committed()
    total = sum(p.stat().st_size for p in files)
    biggest = sorted(files, key=lambda p: p.stat().st_size)[-3:]
    assert total < LIMIT, f"results/ is {total / 2**20:.1f} MiB; biggest: {[str(p) for p in biggest]}"


def test_committed_offline_results_validate() -> None:
    docs = [(p, json.loads(p.read_text())) for p in _committed() if p.suffix == ".json"]
    offline = [(p, d) for p, d in docs
               if isinstance(d, dict) and d.get("benchmark") == "specserve.spec_benchmark"]
    assert offline
    for p, d in offline:
        assert validate(d) == [], p
