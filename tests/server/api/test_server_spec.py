"""Speculative decoding through the HTTP server with the real `openai` client: same greedy text with
and without --speculative-config, counters and the SpecDecoding log line."""

from __future__ import annotations

import logging
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import default_model

COPY = ("Repeat this text exactly: The quick brown fox jumps over the lazy dog near the river bank. "
        "A small bird sings on the old oak tree while the farmer walks to the market.")
QUESTIONS = [COPY, "What is the capital of France?", "List three colours of the rainbow."]


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:spec_decode"):
                key = s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "")
                out[key] = s.value
    return out


def chat(client: openai.OpenAI, text: str) -> str:
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=40, temperature=0,
                                       messages=[{"role": "user", "content": text}])
    return r.choices[0].message.content or ""


@pytest.fixture(scope="module")
def plain_texts(make_server) -> list[str]:
    with make_server() as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        return [chat(client, q) for q in QUESTIONS]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_same_greedy_text_with_speculation_and_counters(method: str, make_server, plain_texts: list[str],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if method == "draft_model":
        cfg = {"method": "draft_model", "model": default_model().path, "num_speculative_tokens": 3}
    caplog.set_level(logging.INFO)
    with make_server(speculative_config=cfg, per_request_spec_decode_metrics="summary",
                     log_stats_interval=0.5) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        before = spec_counters(srv.url)
        assert before["vllm:spec_decode_num_drafts_total"] == 0
        texts = [chat(client, q) for q in QUESTIONS]
        assert texts == plain_texts
        after = spec_counters(srv.url)
        drafts = after["vllm:spec_decode_num_drafts_total"]
        drafted = after["vllm:spec_decode_num_draft_tokens_total"]
        accepted = after["vllm:spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and 0 < accepted <= drafted
        k = cfg["num_speculative_tokens"]
        per_pos = [after[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(k)]
        assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted
        assert 0 < after["vllm:spec_decode_draft_acceptance_rate"] <= 1

        # Per-request summary in usage, and it sums to what the counters moved by.
        r = client.chat.completions.create(model=srv.client.model_name, max_tokens=40, temperature=0,
                                           messages=[{"role": "user", "content": COPY}])
        usage = r.usage.model_dump()
        spec = usage["spec_decode"]
        again = spec_counters(srv.url)
        assert spec["num_draft_tokens"] == again["vllm:spec_decode_num_draft_tokens_total"] - drafted
        assert spec["num_accepted_tokens"] == again["vllm:spec_decode_num_accepted_tokens_total"] - accepted
        assert srv.kv_pool_full()
        # The stats task logs vLLM's line within an interval or two.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not any(
                "SpecDecoding metrics: Mean acceptance length" in m for m in caplog.messages):
            time.sleep(0.1)
        assert any("SpecDecoding metrics: Mean acceptance length" in m and "Per-position acceptance rate"
                   in m for m in caplog.messages)


def test_sampled_requests_draft_and_equal_plain_decoding(make_server) -> None:
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    body = {"max_tokens": 40, "temperature": 0.5, "seed": 1, "messages": [{"role": "user", "content": COPY}]}
    texts = []
    for spec in (None, cfg):
        with make_server(speculative_config=spec) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="x")
            out = client.chat.completions.create(model=srv.client.model_name, **body)
            texts.append(out.choices[0].message.content)
            if spec is not None:
                counters = spec_counters(srv.url)
                assert counters["vllm:spec_decode_num_draft_tokens_total"] > 0
                assert counters["vllm:spec_decode_num_accepted_tokens_total"] > 0
            assert srv.kv_pool_full()
    assert texts[0] == texts[1]  # a seeded sampled request: plain decoding's text, speculation or not


def test_bad_speculative_config_fails_at_startup() -> None:
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 9, '
                          '"prompt_lookup_max": 2}'], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "prompt_lookup_min" in res.stderr and "Traceback" not in res.stderr


def _generation_metrics(url: str) -> tuple[float, float, float]:
    """(generation tokens counter, per-request generation tokens histogram sum and count)."""
    text = httpx.get(url + "/metrics").text
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return (got["vllm:generation_tokens_total"], got["vllm:request_generation_tokens_sum"],
            got["vllm:request_generation_tokens_count"])


STOPS = ["lazy", "river bank", "bird sings", "oak", "farmer"]


def test_stop_string_inside_accepted_drafts_counts_like_plain(make_server) -> None:
    """A stop string that ends inside a step's accepted drafts: usage and the generation-token metrics
    count only the tokens up to the one that completed it, as plain decoding does."""
    def run(**settings: object) -> tuple[list[tuple], tuple[float, ...], float]:
        with make_server(**settings) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="x")
            before = _generation_metrics(srv.url)
            got = []
            for stop in STOPS:
                r = client.chat.completions.create(model=srv.client.model_name, max_tokens=60, temperature=0,
                                                   stop=[stop], messages=[{"role": "user", "content": COPY}])
                choice = r.choices[0]
                got.append((choice.message.content, choice.finish_reason, r.usage.completion_tokens))
            deadline = time.monotonic() + 5  # stats arrive right after the outputs
            while _generation_metrics(srv.url)[2] - before[2] < len(STOPS) and time.monotonic() < deadline:
                time.sleep(0.05)
            after = _generation_metrics(srv.url)
            accepted = spec_counters(srv.url).get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
            assert srv.kv_pool_full()
            return got, tuple(a - b for a, b in zip(after, before, strict=True)), accepted

    plain, plain_metrics, _ = run()
    spec, spec_metrics, accepted = run(speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    assert accepted > 0
    assert all(reason == "stop" for _, reason, _ in plain)
    assert spec == plain
    assert spec_metrics == plain_metrics == (sum(n for *_, n in plain),) * 2 + (len(STOPS),)
