"""`--step-trace FILE`: one JSON line per engine step, consistent with /metrics; loadtests.traces."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from loadtests import traces as step_trace
from server.settings import ServerSettings
from tests.server.monitoring.test_server_metrics import MODEL, scrape, value, wait_for

COPY = ("Repeat this list exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. "
        "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu.")


def test_trace_matches_what_the_server_did(make_server: Callable, tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    spec = {"method": "ngram", "num_speculative_tokens": "auto", "prompt_lookup_min": 2}
    with make_server(step_trace=str(path), speculative_config=spec) as srv:
        body = {"model": MODEL, "prompt": COPY, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=srv.url, timeout=120) as c, \
                concurrent.futures.ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda _: c.post("/v1/completions", json=body).json(), range(3)))
        completion = sum(o["usage"]["completion_tokens"] for o in outs)
        wait_for(lambda: value(scrape(srv.url), "vllm:generation_tokens_total") == completion, timeout=5)
        metrics = scrape(srv.url)
    # The server is stopped: the trace is closed and complete.
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert recs, "no steps traced"
    assert sum(r["generated"] for r in recs) == completion == 72
    drafted = value(metrics, "vllm:spec_decode_num_draft_tokens_total", engine="0")
    accepted = value(metrics, "vllm:spec_decode_num_accepted_tokens_total", engine="0")
    assert sum(r["drafts_verified"] for r in recs) == drafted > 0
    assert sum(r["drafts_accepted"] for r in recs) == accepted
    num_drafts = value(metrics, "vllm:spec_decode_num_drafts_total", engine="0")
    assert sum(r["requests_drafting"] for r in recs) == num_drafts > 0
    assert max(r["requests"] for r in recs) >= 2  # the three requests shared steps
    for r in recs:
        assert r["step_s"] > 0 and r["requests"] >= 1
        # Each request computes a token at least, plus its drafts; it emits one, plus accepted drafts.
        assert r["tokens"] >= r["requests"] + r["drafts_verified"]
        assert r["generated"] <= r["requests"] + r["drafts_accepted"]
        assert all(k >= 0 for k in r["next_k"])
        assert set(r["cost_model"]) >= {"step_1_token_seconds", "draft_per_token_seconds"}
    times = [r["t"] for r in recs]
    assert times == sorted(times)

    summary = step_trace.summarise(step_trace.load(str(path)))
    assert summary["steps"] == len(recs)
    assert summary["decode_steps"] + summary["prefill_steps"] == len(recs)
    assert summary["generated"] == completion
    assert summary["prefill_steps"] >= 1  # the prompts were prefilled inside the trace
    rows = summary["by_requests"]
    assert sum(r["plain_steps"] + r["drafting_steps"] for r in rows) == summary["decode_steps"]
    assert step_trace.main([str(path), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())[str(path)]["steps"] == len(recs)


def test_summary_counts_step_shapes_and_skips_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = {"t": 1.0, "step_s": 0.1, "requests": 2, "tokens": 3, "generated": 2, "drafts_verified": 1,
            "drafts_accepted": 0}
    plain = {**good, "t": 2.0, "tokens": 2, "drafts_verified": 0}
    torn = '{"t": 3.0, "step_s"'  # a server killed mid-write
    path.write_text(json.dumps(good) + "\n" + json.dumps(plain) + "\n" + torn)
    recs = step_trace.load(str(path))
    assert len(recs) == 2
    s = step_trace.summarise(recs)
    (row,) = s["by_requests"]
    assert (row["plain_steps"], row["drafting_steps"]) == (1, 1)
    assert s["drafts_verified"] == 1 and s["decode_steps"] == 2


def test_replay_prices_recorded_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A trace of 8 requests on a machine that speeds up while drafts rise, at 10 ms per draft, with a
    # prefill step in the middle: the replayed prices are the drafts' cost, not the drift.
    from loadtests import replay_prices

    recs, t = [], 0.0
    for i, d in enumerate([0, 2, 1, 3, 2, 4, 3, 5, 4, 6, 5, 7, 6, 8] * 3):
        t += 0.3
        recs.append({"t": t, "step_s": 0.30 - 0.002 * i + 0.010 * d, "requests": 8, "tokens": 8 + d,
                     "generated": 8, "drafts_verified": d, "drafts_accepted": 0,
                     "requests_drafting": min(d, 8)})
        if i == 20:
            recs.append({**recs[-1], "t": t + 0.1, "step_s": 1.5, "tokens": 200, "drafts_verified": 0})
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    (prices,) = replay_prices.replay(step_trace.load(str(path)), replay_prices.cost_module(None)).values()
    assert len(prices) > 20
    assert all(abs(p[1] - 0.010) < 0.0005 for p in prices[-10:])
    assert replay_prices.main([str(path), "--rows", "8"]) == 0
    assert "| 8 |" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["/nonexistent-dir/x.jsonl", "."])
def test_unwritable_trace_path_fails_at_startup(bad: str) -> None:
    with pytest.raises(ValidationError, match="step trace"):
        ServerSettings(step_trace=bad)
