"""configs/: every example config starts a valid engine configuration, the Prometheus config scrapes
the default address, and the dashboard's queries name series a real server exports.
(Dockerfile.dev is checked in tests/packaging/test_dockerfile.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from engine.config import EngineConfig
from engine.spec.config import parse_speculative_config
from server.cli import build_parser
from server.cli.serve import resolve_settings

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DASHBOARD = ROOT / "configs" / "grafana" / "specserve-dashboard.json"
SERIES = re.compile(r"\b((?:vllm|specserve):[a-z0-9_]+)")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_server_configs_validate(path: Path) -> None:
    settings = resolve_settings(build_parser().parse_args(["serve", "--config", str(path)]), {})
    kwargs = settings.engine_config_kwargs()
    config = EngineConfig(**kwargs)  # the speculative JSON is parsed into its pydantic model here
    assert config.speculative_config is not None
    spec = parse_speculative_config(kwargs["speculative_config"])
    assert spec.method in path.stem and spec.num_speculative_tokens >= 1


def test_every_speculative_method_has_an_example() -> None:
    methods = {yaml.safe_load(p.read_text())["speculative-config"]["method"] for p in CONFIGS}
    assert {"ngram", "suffix", "draft_model", "mtp", "eagle3"} <= methods


def test_prometheus_config_scrapes_the_default_address() -> None:
    doc = yaml.safe_load((ROOT / "configs" / "prometheus.yml").read_text())
    job = doc["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    default = resolve_settings(build_parser().parse_args(["serve"]), {})
    assert f"{default.host}:{default.port}" in job["static_configs"][0]["targets"]


def _dashboard_exprs() -> list[str]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in doc["templating"]["list"]]
    return exprs


def test_dashboard_covers_what_operators_watch() -> None:
    titles = " ".join(p["title"].lower() for p in json.loads(DASHBOARD.read_text())["panels"])
    for topic in ("acceptance rate", "per-position", "first token", "per output token", "running / waiting",
                  "kv cache"):
        assert topic in titles, topic


def test_dashboard_series_exist_in_a_real_scrape(make_server) -> None:  # noqa: ANN001
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    with make_server(speculative_config=spec) as srv:
        name = httpx.get(f"{srv.base_url}/models").json()["data"][0]["id"]
        text = " ".join(["one two three four five six seven eight nine ten"] * 3)
        r = httpx.post(f"{srv.base_url}/completions", timeout=120, json={
            "model": name, "prompt": f"Repeat exactly: {text}\n{text}\n", "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        scrape = httpx.get(f"{srv.url}/metrics").text
    exported = {line.split("{")[0].split(" ")[0] for line in scrape.splitlines() if line and line[0] != "#"}
    used = {m for e in _dashboard_exprs() for m in SERIES.findall(e)}
    assert len(used) >= 12
    missing = sorted(m for m in used if m not in exported)
    assert not missing, f"dashboard queries series the server does not export: {missing}"
    assert 'position="0"' in scrape and "model_name=" in scrape  # labels the queries group by
