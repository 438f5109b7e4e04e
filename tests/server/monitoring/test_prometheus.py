"""A real Prometheus (Debian's `prometheus` package) scrapes a real server during a load run; its PromQL
acceptance rate must equal the run's own count, summed from the responses' per-request stats, and the
dashboard's TPOT / inter-token latency quantiles must evaluate.

Skipped with a reason where the binary is absent; `.ci/run` installs it where it can.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.servers import free_port
from tests.conftest import RunningServer

ROOT = Path(__file__).resolve().parents[3]

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed "
                                "(apt-get install prometheus; .ci/run does this where it can)")
# A window longer than the whole run (which takes over a minute on a loaded machine), so the ratio
# covers every step of it.
QUERY = ("rate(vllm:spec_decode_num_accepted_tokens_total[10m]) / "
         "rate(vllm:spec_decode_num_draft_tokens_total[10m])")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture
def prometheus(tmp_path: Path, make_server) -> Iterator[tuple[RunningServer, str]]:  # noqa: ANN001
    with make_server(speculative_config=NGRAM, per_request_spec_decode_metrics="summary") as srv:
        target = srv.url.removeprefix("http://")
        config = tmp_path / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: specserve\n"
                          f"    static_configs:\n      - targets: ['{target}']\n")
        port = free_port()
        log = (tmp_path / "prometheus.log").open("w")
        args = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'db'}",
                f"--web.listen-address=127.0.0.1:{port}"]
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        api = f"http://127.0.0.1:{port}/api/v1"
        try:
            yield srv, api
        finally:
            proc.terminate()
            proc.wait(10)
            log.close()


def _query(api: str, expr: str, at: float) -> list[dict]:
    r = httpx.get(f"{api}/query", params={"query": expr, "time": at}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def _wait_scrapes(api: str, n: int, timeout: float = 30) -> float:
    """Wait until Prometheus has `n` more successful scrapes of the target; returns the last one's time."""
    deadline = time.monotonic() + timeout
    seen: list[float] = []
    while time.monotonic() < deadline:
        try:
            res = _query(api, "up", time.time())
        except httpx.HTTPError:
            res = []
        if res and res[0]["value"][1] == "1":
            ts = float(res[0]["value"][0])
            last = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"][0]["lastScrape"]
            if last not in seen:
                seen.append(last)
            if len(seen) > n:
                return ts
        time.sleep(0.3)
    raise AssertionError("prometheus did not scrape the server in time")


async def _load(url: str, model: str) -> tuple[int, int]:
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    bodies = [{"model": model, "prompt": f"Repeat this line three times: {text}\n{text}\n{i}",
               "max_tokens": 40, "temperature": 0, "ignore_eos": True} for i in range(6)]
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        out = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
    stats = [r.json()["usage"]["spec_decode"] for r in out]
    return sum(s["num_accepted_tokens"] for s in stats), sum(s["num_draft_tokens"] for s in stats)


def test_promql_acceptance_rate_equals_the_runs_own_count(prometheus: tuple[RunningServer, str]) -> None:
    srv, api = prometheus
    _wait_scrapes(api, 2)  # samples from before the load: the window starts at zero
    accepted, drafted = asyncio.run(_load(srv.url, srv.client.model_name))
    assert drafted > 0 and 0 < accepted <= drafted
    at = _wait_scrapes(api, 2)  # the final counters are in
    result = _query(api, QUERY, at)
    assert len(result) == 1, result
    promql = float(result[0]["value"][1])
    assert promql == pytest.approx(accepted / drafted, rel=1e-6), (promql, accepted, drafted)
    assert result[0]["metric"]["model_name"] == srv.client.model_name

    # vLLM's latency pair: one TPOT sample per request, one inter-token gap per request-step after the
    # first token. Accepted drafts make steps that emit several tokens, so there are fewer gaps than tokens.
    def scalar(expr: str) -> float:
        (sample,) = _query(api, expr, at)
        return float(sample["value"][1])

    requests = scalar("vllm:request_time_per_output_token_seconds_count")
    gaps = scalar("vllm:inter_token_latency_seconds_count")
    assert requests >= 6 and 0 < gaps < scalar("vllm:generation_tokens_total") - requests
    # The dashboard's latency quantiles evaluate on these series.
    dashboard = json.loads((ROOT / "configs" / "grafana" / "specserve-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]
             if "inter_token_latency" in t["expr"] or "request_time_per_output_token" in t["expr"]]
    assert len(exprs) == 4
    for expr in exprs:
        assert 0 < scalar(expr.replace("$model_name", ".*")) < 80, expr
