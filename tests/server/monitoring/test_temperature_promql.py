"""The acceptance-against-temperature PromQL of docs/monitoring.md, evaluated by `promtool test rules` on
synthetic series: greedy drafts accepted 9 in 10, temperature-1.0 ones 1 in 20. The series it names
must be ones server/metrics.py exposes. Skipped where promtool is absent (Debian's `prometheus` package)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from server.metrics import EngineSnapshot, Metrics

ROOT = Path(__file__).resolve().parents[3]
PROMTOOL = shutil.which("promtool")
SECTION = "### Acceptance against temperature"
# Per bucket, over 10 minutes: (drafts, draft tokens, accepted) per minute, and each request's acceptance.
LOAD = {"0": (30, 100, 90, 0.9), "(0.5,1]": (50, 100, 5, 0.05)}
# The four queries in the order the section gives them: token rate, mean acceptance length, per-request
# median, per-request mean.
EXPECTED = [{"0": 0.9, "(0.5,1]": 0.05}, {"0": 4.0, "(0.5,1]": 1.1}, {"0": 0.85, "(0.5,1]": 0.05},
            {"0": 0.9, "(0.5,1]": 0.05}]
RATE_BUCKETS = ("0.0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "0.95", "1.0", "+Inf")


def documented_queries() -> list[str]:
    text = (ROOT / "docs" / "monitoring.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n#", 1)[0]
    queries: list[str] = []
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        for line in block.splitlines():
            if line.startswith(" ") and queries:
                queries[-1] += " " + line.strip()  # a continuation line
            elif line.strip():
                queries.append(line.strip())
    return queries


def input_series() -> list[dict[str, str]]:
    out = []
    for bucket, (drafts, tokens, accepted, per_request) in LOAD.items():
        labels = f'model_name="m",temperature="{bucket}"'
        for metric, per_min in (("num_drafts", drafts), ("num_draft_tokens", tokens),
                                ("num_accepted_tokens", accepted)):
            out.append({"series": f"specserve:spec_decode_{metric}_total{{{labels}}}",
                        "values": f"0+{per_min}x10"})
        name = "specserve:request_spec_decode_acceptance_rate"
        for le in RATE_BUCKETS:  # 10 requests a minute, all at `per_request`
            n = 10 if le == "+Inf" or float(le) >= per_request else 0
            out.append({"series": f'{name}_bucket{{{labels},le="{le}"}}', "values": f"0+{n}x10"})
        out.append({"series": f"{name}_sum{{{labels}}}", "values": f"0+{10 * per_request}x10"})
        out.append({"series": f"{name}_count{{{labels}}}", "values": "0+10x10"})
    return out


def test_documented_queries_name_exposed_series() -> None:
    queries = documented_queries()
    assert len(queries) == len(EXPECTED), queries
    exposed = Metrics("m", lambda: EngineSnapshot(0, 0, 1, 1), num_speculative_tokens=4).render().decode()
    for name in {n for q in queries for n in re.findall(r"specserve:[a-z_]+", q)}:
        assert re.search(rf"^{re.escape(name)}{{.*temperature=", exposed, re.M), name


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
def test_documented_queries_evaluate_per_temperature(tmp_path: Path) -> None:
    # promtool compares exactly: rounded to 1e-3 (as 1/1000, so that 0.9 comes out as 0.9).
    tests = [{"expr": f"round(({q}), 0.001)", "eval_time": "10m",
              "exp_samples": [{"labels": f'{{temperature="{b}"}}', "value": v} for b, v in want.items()]}
             for q, want in zip(documented_queries(), EXPECTED, strict=True)]
    spec = {"rule_files": [], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": input_series(), "promql_expr_test": tests}]}
    path = tmp_path / "test.yml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    proc = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
