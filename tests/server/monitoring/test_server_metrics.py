"""/metrics (Prometheus text, vLLM names) and aborting the requests of clients that go away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling import TEMPERATURE_BUCKETS, SamplingParams, temperature_bucket
from engine.stats import FinishedRequestStats, IterationStats, SpecDecodingStats
from server.metrics import EngineSnapshot, Metrics
from tests.conftest import RunningServer

MODEL = "SmolLM2-135M-Instruct"
LABEL = {"model_name": MODEL}

REQUIRED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "specserve:kv_cache_free_blocks": "gauge",
    "specserve:kv_cache_total_blocks": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one /metrics scrape (parsed by prometheus_client)."""
    resp = httpx.get(url + "/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({**LABEL, **labels}.items()))), 0.0)


def wait_for(check: Callable[[], bool], timeout: float) -> float:
    """Seconds until check() held; fails after `timeout`."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(0.02)
    return time.monotonic() - t0


def test_metrics_parse_with_vllm_names(server_url: str) -> None:
    resp = httpx.get(server_url + "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name, kind in REQUIRED.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
    # vLLM deprecated the TPOT histogram for vllm:inter_token_latency_seconds: it is gone here too.
    assert "vllm:time_per_output_token_seconds" not in families
    samples = scrape(server_url)
    total = value(samples, "specserve:kv_cache_total_blocks")
    assert total > 0 and value(samples, "specserve:kv_cache_free_blocks") == total
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.0
    assert value(samples, "vllm:num_requests_running") == 0.0


def test_counters_move_by_known_amounts(server: RunningServer) -> None:
    before = scrape(server.url)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        a = c.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                            "max_tokens": 7, "temperature": 0, "ignore_eos": True}).json()
        messages = [{"role": "user", "content": "hi"}]
        b = c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 24,
                                                 "temperature": 0}).json()
    prompt = a["usage"]["prompt_tokens"] + b["usage"]["prompt_tokens"]
    gen = a["usage"]["completion_tokens"] + b["usage"]["completion_tokens"]
    assert a["choices"][0]["finish_reason"] == "length"
    reasons = [a["choices"][0]["finish_reason"], b["choices"][0]["finish_reason"]]

    def delta(name: str, **labels: str) -> float:
        return value(scrape(server.url), name, **labels) - value(before, name, **labels)

    # The engine reports a step's stats right after its outputs: allow it a moment.
    wait_for(lambda: delta("vllm:e2e_request_latency_seconds_count") >= 2, timeout=5)
    after = scrape(server.url)

    def d(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert d("vllm:prompt_tokens_total") == prompt
    assert d("vllm:generation_tokens_total") == gen
    for reason in ("stop", "length"):
        assert d("vllm:request_success_total", finished_reason=reason) == reasons.count(reason)
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_time_per_output_token_seconds"):
        assert d(hist + "_count") == 2, hist
        assert d(hist + "_sum") >= 0
    # Without speculation every step after a request's first token emits one token: one gap each.
    assert d("vllm:inter_token_latency_seconds_count") == gen - 2
    assert 0 < d("vllm:inter_token_latency_seconds_sum") < d("vllm:e2e_request_latency_seconds_sum")
    assert d("vllm:e2e_request_latency_seconds_sum") > d("vllm:time_to_first_token_seconds_sum") > 0
    assert value(after, "vllm:num_requests_running") == 0


async def _open_streams(url: str, n: int, body: dict, read_chunks: int) -> None:
    """Start n streaming requests, read a few chunks of each, then drop every connection at once."""
    clients = [httpx.AsyncClient(base_url=url, timeout=60) for _ in range(n)]
    streams = []
    try:
        for c in clients:
            streams.append(await c.send(c.build_request("POST", "/v1/completions", json=body), stream=True))

        async def read(resp: httpx.Response) -> int:
            got = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got == read_chunks:
                        break
            return got

        assert await asyncio.gather(*(read(s) for s in streams)) == [read_chunks] * n
    finally:
        for s in streams:
            await s.aclose()
        for c in clients:
            await c.aclose()


def test_client_disconnect_aborts_and_frees_kv(server: RunningServer) -> None:
    before = scrape(server.url)
    body = {"model": MODEL, "prompt": "Tell me a very long story about dragons.", "max_tokens": 1000,
            "temperature": 0.8, "ignore_eos": True, "stream": True}
    asyncio.run(_open_streams(server.url, 4, body, read_chunks=3))

    def drained() -> bool:
        s = scrape(server.url)
        return (value(s, "vllm:num_requests_running") == 0 and value(s, "vllm:num_requests_waiting") == 0
                and value(s, "specserve:kv_cache_free_blocks") == value(s, "specserve:kv_cache_total_blocks"))

    elapsed = wait_for(drained, timeout=1.0)
    assert elapsed < 1.0
    assert server.idle()
    after = scrape(server.url)
    assert (value(after, "vllm:request_success_total", finished_reason="abort")
            - value(before, "vllm:request_success_total", finished_reason="abort")) == 4
    # generated far fewer than the 4000 tokens asked for
    assert value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total") < 200


def test_non_streaming_client_timeout_aborts(server: RunningServer) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    wait_for(server.idle, timeout=1.5)
    assert value(scrape(server.url), "vllm:num_requests_running") == 0


def test_engine_gauges_track_a_running_request(server: RunningServer) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:  # a plain loop: closing a generator over `lines` would close the connection
            if line.startswith("data: "):
                break
        s = scrape(server.url)
        assert value(s, "vllm:num_requests_running") == 1
        assert value(s, "specserve:kv_cache_free_blocks") < value(s, "specserve:kv_cache_total_blocks")
        assert 0 < value(s, "vllm:kv_cache_usage_perc") < 1
    wait_for(server.idle, timeout=1.5)


# -- acceptance against temperature (issue #36), the metrics module driven with stats objects -----------
def spec_metrics() -> tuple[Metrics, Callable[[], dict]]:
    m = Metrics(MODEL, lambda: EngineSnapshot(0, 0, 1, 1), num_speculative_tokens=4)

    def samples() -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    return m, samples


def finished(temperature: float, drafted: int, accepted: int) -> FinishedRequestStats:
    return FinishedRequestStats("stop", 5, 20, 1.0, 0.0, 0.1, 0.05, 0, temperature=temperature,
                                spec_num_draft_tokens=drafted, spec_num_accepted_tokens=accepted)


def test_temperature_buckets() -> None:
    table = {0.0: "0", 9e-6: "0", 1e-5: "(0,0.5]", 0.3: "(0,0.5]", 0.5: "(0,0.5]", 0.50001: "(0.5,1]",
             0.7: "(0.5,1]", 1.0: "(0.5,1]", 1.0001: ">1", 2.0: ">1"}
    for t, bucket in table.items():
        assert temperature_bucket(t) == bucket, t
        assert (bucket == "0") == SamplingParams(temperature=t).is_greedy  # the same greedy test
    assert set(table.values()) == set(TEMPERATURE_BUCKETS)


def test_request_acceptance_histogram_is_labelled_by_temperature() -> None:
    m, samples = spec_metrics()
    m.on_iteration(IterationStats(0.0, 0.0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, finished=[
        finished(0.0, 10, 9), finished(0.7, 10, 2), finished(1.5, 0, 0)]))  # the last one never drafted
    s = samples()
    name = "specserve:request_spec_decode_acceptance_rate"

    def hist(suffix: str, temperature: str, **le: str) -> float:
        return s[(name + suffix, tuple(sorted({**LABEL, "temperature": temperature, **le}.items())))]

    assert hist("_count", "0") == 1 and hist("_sum", "0") == pytest.approx(0.9)
    assert hist("_count", "(0.5,1]") == 1 and hist("_sum", "(0.5,1]") == pytest.approx(0.2)
    assert hist("_bucket", "(0.5,1]", le="0.1") == 0 and hist("_bucket", "(0.5,1]", le="0.2") == 1
    assert hist("_bucket", "0", le="0.8") == 0 and hist("_bucket", "0", le="0.9") == 1
    # Every bucket is exposed from the start; a request that never drafted is no observation.
    assert hist("_count", "(0,0.5]") == 0 and hist("_count", ">1") == 0
    assert {dict(k[1]).get("temperature") for k in s if k[0] == name + "_count"} == {
        "0", "(0,0.5]", "(0.5,1]", ">1"}


def test_spec_counters_by_temperature_add_up_to_vllms() -> None:
    m, samples = spec_metrics()
    spec = SpecDecodingStats()
    for drafted, accepted, bucket in ((4, 4, "0"), (4, 3, "0"), (3, 0, "(0.5,1]"), (2, 1, ">1")):
        spec.observe(drafted, accepted, bucket)
    m.on_iteration(IterationStats(0.0, 0.0, 4, 0, 12, 4, 0, 0.0, 0, 0, 0, spec=spec))
    s = samples()

    def ours(metric: str, temperature: str) -> float:
        return value(s, f"specserve:spec_decode_{metric}_total", temperature=temperature)

    want = {"0": (2, 8, 7), "(0,0.5]": (0, 0, 0), "(0.5,1]": (1, 3, 0), ">1": (1, 2, 1)}
    for bucket, counts in want.items():
        assert tuple(ours(k, bucket) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")) \
            == counts, bucket
    for i, metric in enumerate(("num_drafts", "num_draft_tokens", "num_accepted_tokens")):
        # vLLM's counters: the same totals, under vLLM's labels only (no temperature).
        assert value(s, f"vllm:spec_decode_{metric}_total", engine="0") == sum(c[i] for c in want.values())
        assert not any(k[0] == f"vllm:spec_decode_{metric}_total" and "temperature" in dict(k[1]) for k in s)


@pytest.mark.parametrize(("rule", "lossless"), [("standard", "true"), ("block", "true"), ("typical", "false"),
                                                ("synthetic", "false")])
def test_config_info_marks_lossy_verification(rule: str, lossless: str) -> None:
    m = Metrics("m", lambda: EngineSnapshot(0, 0, 1, 1), num_speculative_tokens=2, spec_method="ngram",
                rejection_sample_method=rule)
    text = m.render().decode()
    want = (f'specserve:spec_decode_config_info{{lossless="{lossless}",method="ngram",model_name="m",'
            f'rejection_sample_method="{rule}"}} 1.0')
    assert want in text, text[-2000:]
