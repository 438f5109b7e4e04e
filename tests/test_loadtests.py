"""The load generator (loadtests/) against real in-process servers, plus its pure parts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loadtests import cli
from loadtests.plots import PNG_SIGNATURE
from loadtests.prom import SpecCounters, acceptance_summary, merge_spec, parse_spec_counters
from loadtests.runner import percentile
from loadtests.servers import ServerProcess, ServerSpec
from loadtests.suite import DOCS_END, DOCS_PAGE, DOCS_START, results_markdown, update_docs
from loadtests.workloads import WORKLOADS, load_workload

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
DIST_KEYS = {"mean", "p50", "p90", "p99"}

METRICS_TEXT = """\
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 2.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 99.0
"""


def test_parse_and_diff_spec_counters() -> None:
    after = parse_spec_counters(METRICS_TEXT)
    assert after is not None and after.per_pos == {0: 10.0, 1: 8.0, 2: 5.0, 3: 2.0}
    before = SpecCounters(drafts=4, draft_tokens=16, accepted=10, per_pos={0: 4, 1: 3, 2: 2, 3: 1})
    s = acceptance_summary(after.minus(before))
    assert s is not None
    assert (s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (6, 24, 15)
    assert s["acceptance_rate"] == pytest.approx(15 / 24)
    assert s["mean_acceptance_length"] == pytest.approx(1 + 15 / 6)
    assert s["accepted_per_position"] == [6, 5, 3, 1]
    assert merge_spec([s, s])["acceptance_rate"] == pytest.approx(15 / 24)
    assert parse_spec_counters('vllm:generation_tokens_total{model_name="m"} 1.0\n') is None


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_workloads_ship_with_the_repo() -> None:
    for name in WORKLOADS:
        items = load_workload(name)
        assert len(items) >= 12, name
        assert all(it.messages and it.messages[0]["content"].strip() for it in items)
    mixed = load_workload("mixed-temp")
    temps = [it.temperature for it in mixed]
    assert 0.0 in temps and all(t == 0 or 0.7 <= t <= 1.0 for t in temps)
    assert any(t > 0 for t in temps)
    # Sampled items carry a seed, the same on every load (servers compared sample the same text).
    seeds = [it.extra.get("seed") for it in mixed if it.temperature > 0]
    assert None not in seeds and len(set(seeds)) == len(seeds)
    assert seeds == [it.extra["seed"] for it in load_workload("mixed-temp") if it.temperature > 0]
    assert all("seed" not in it.extra for it in mixed if it.temperature == 0)
    assert min(len(it.messages[0]["content"]) for it in load_workload("long")) > 3000
    assert load_workload("copy")[0].id == load_workload("copy")[0].id  # seeded: same order every time


def _check_level(lvl: dict[str, Any], n: int) -> None:
    assert lvl["num_requests"] == n and lvl["completed"] == n and lvl["failed"] == 0
    assert lvl["concurrency"] == 2 and lvl["output_tokens"] > 0 and lvl["output_throughput_tok_s"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(lvl[key]) == DIST_KEYS and lvl[key]["p50"] is not None, key
        assert lvl[key]["p50"] <= lvl[key]["p90"] <= lvl[key]["p99"]
    assert len(lvl["requests"]) == n
    for r in lvl["requests"]:
        assert r["ok"] and r["usage_reported"] and 0 < r["output_tokens"] <= 16
        assert r["ttft"] <= r["e2e"] and len(r["itl"]) == r["chunks"] - 1


def test_run_against_real_servers_writes_json_and_png(make_server: Any, tmp_path: Path) -> None:
    docs = {}
    for label, spec in (("off", None), ("ngram", NGRAM)):
        with make_server(speculative_config=spec) as srv:
            out = tmp_path / f"{label}.json"
            png = tmp_path / f"{label}.png"
            rc = cli.main(["run", "--url", srv.url, "--workload", "copy", "--concurrency", "2",
                           "--num-requests", "6", "--max-tokens", "16", "--duration", "60", "--warmup", "1",
                           "--label", label, "--output-json", str(out), "--plot", str(png)])
            assert rc == 0
            assert srv.idle()
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        docs[label] = doc = json.loads(out.read_text())
        assert doc["schema"] == "specserve-loadtest/1" and doc["kind"] == "run"
        assert doc["config"]["max_tokens"] == 16 and doc["config"]["levels"] == ["c2"]
        (run,) = doc["runs"]
        assert run["label"] == label and run["workload"] == "copy"
        (lvl,) = run["levels"]
        _check_level(lvl, 6)
    assert docs["off"]["runs"][0]["levels"][0]["spec_decode"] is None
    spec = docs["ngram"]["runs"][0]["levels"][0]["spec_decode"]
    assert spec["num_draft_tokens"] > 0 and 0 <= spec["acceptance_rate"] <= 1
    assert len(spec["accepted_per_position"]) <= 4 and spec["mean_acceptance_length"] >= 1
    overlay = tmp_path / "overlay.png"
    inputs = [str(tmp_path / "off.json"), str(tmp_path / "ngram.json")]
    assert cli.main(["plot", *inputs, "-o", str(overlay)]) == 0
    assert overlay.read_bytes()[:8] == PNG_SIGNATURE


def test_poisson_mode_stops_by_itself(server: Any, tmp_path: Path) -> None:
    out = tmp_path / "qps.json"
    rc = cli.main(["run", "--url", server.url, "--workload", "chat", "--qps", "4", "--num-requests", "50",
                   "--duration", "1.5", "--max-tokens", "4", "--warmup", "0", "--output-json", str(out),
                   "--plot", str(tmp_path / "qps.png")])
    assert rc == 0
    (lvl,) = json.loads(out.read_text())["runs"][0]["levels"]
    assert lvl["qps"] == 4 and lvl["concurrency"] is None
    assert 1 <= lvl["num_requests"] < 50 and lvl["failed"] == 0  # the 1.5 s bound, not the count, ended it


def test_server_that_cannot_start_is_reported(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    srv = ServerProcess(ServerSpec("broken", command=cmd, startup_timeout_s=20), tmp_path / "broken.log")
    assert not srv.start()
    assert "status 3" in (srv.error or "") and "boom" in (srv.error or "")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_server_page_faults_are_read_from_proc(tmp_path: Path) -> None:
    srv = ServerProcess(ServerSpec("faulty", command=None), tmp_path / "x.log")
    assert srv.minor_faults() is None  # not started by us
    # 64 MB written: at least 16,000 pages faulted in.
    code = "import sys, time; b = bytearray(64 << 20); print('up', flush=True); time.sleep(30)"
    srv.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert srv.proc.stdout is not None and srv.proc.stdout.readline().strip() == b"up"
        faults = srv.minor_faults()
        assert faults is not None and faults > 16_000
    finally:
        srv.stop()
    assert srv.minor_faults() is None


def test_results_markdown_and_docs_markers(tmp_path: Path) -> None:
    def level(c: int, tps: float, spec: dict[str, Any] | None) -> dict[str, Any]:
        d = {"mean": 0.05, "p50": 0.05, "p90": 0.06, "p99": 0.07}
        return {"level": f"c{c}", "concurrency": c, "qps": None, "num_requests": 4, "completed": 4,
                "output_throughput_tok_s": tps, "ttft_s": d, "tpot_s": d, "e2e_s": d, "spec_decode": spec}

    spec = acceptance_summary(SpecCounters(10, 40, 25, {0: 10, 1: 8, 2: 5, 3: 2}))
    doc = {"created": "now", "environment": {"platform": "linux", "cpu_count": 2, "load_average_1m": 1.0},
           "config": {"max_tokens": 64, "min_requests": 4, "workloads": ["copy"], "levels": ["c1", "c8"]},
           "unavailable": [{"label": "mtp", "error": "no MTP loader"}],
           "runs": [{"label": "off", "workload": "copy", "levels": [level(1, 20, None), level(8, 60, None)]},
                    {"label": "ngram", "workload": "copy",
                     "levels": [level(1, 40, spec), level(8, 90, spec)]},
                    {"label": "mlx_lm.server", "workload": "copy",
                     "levels": [level(1, 10, None), level(8, 30, None)]}]}
    md = results_markdown(doc)
    assert "| 1 | ngram | 4/4 | 40.0 | 2.00 |" in md and "no MTP loader" in md
    assert "pos 4" in md and "| copy | 8 | 2.00 |" in md
    # The suite writes into the load-test page, which carries the markers (once each).
    assert DOCS_PAGE.name == "load-tests.md" and DOCS_PAGE.parent.name == "docs"
    real = DOCS_PAGE.read_text()
    assert real.count(DOCS_START) == 1 and real.count(DOCS_END) == 1
    assert real.index(DOCS_START) < real.index(DOCS_END)
    page = tmp_path / "load-tests.md"
    page.write_text(f"# x\n\n## Results\n\n{DOCS_START}\nold\n{DOCS_END}\nafter\n")
    assert update_docs(md, page)
    text = page.read_text()
    assert "old" not in text and md in text and text.endswith(f"{DOCS_END}\nafter\n")
    page.write_text("# no markers\n")
    assert not update_docs(md, page) and page.read_text() == "# no markers\n"
