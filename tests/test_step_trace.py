"""`--step-trace FILE`: one JSON line per engine step, consistent with /metrics; tools.step_trace."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from server.settings import ServerSettings
from tests.test_server_metrics import MODEL, scrape, value, wait_for
from tools import step_trace

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


@pytest.mark.parametrize("bad", ["/nonexistent-dir/x.jsonl", "."])
def test_unwritable_trace_path_fails_at_startup(bad: str) -> None:
    with pytest.raises(ValidationError, match="step trace"):
        ServerSettings(step_trace=bad)
