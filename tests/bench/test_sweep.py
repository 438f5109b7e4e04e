"""`specserve bench sweep`: servers interleaved level by level, ratios; modes from configs/; starting
server processes. Real servers (in-process ones passed by URL, and one `specserve serve` process)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtests import modes
from loadtests.matrix import MatrixConfig
from loadtests.plots import PNG_SIGNATURE
from loadtests.runner import Level
from loadtests.servers import ServerProcess, ServerSpec, server_spec
from loadtests.sweep import ratios
from server.cli import main
from specserve_configs import shipped

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def test_modes_are_the_example_configs() -> None:
    files = sorted(shipped().glob("*.yaml"))
    with_spec = [p.stem for p in files if "speculative-config" in yaml.safe_load(p.read_text())]
    assert modes.available() == ["off", *with_spec]
    assert {"ngram", "ngram-auto", "suffix", "mtp"} <= set(with_spec)
    assert modes.speculative_config("off") is None
    ngram = yaml.safe_load(shipped("ngram.yaml").read_text())["speculative-config"]
    assert modes.speculative_config("ngram") == ngram
    mine = 'mine={"method": "suffix", "num_speculative_tokens": 2}'
    got = modes.from_flags("off,ngram,ngram-auto", "1,3", [mine], default=[])
    assert list(got) == ["off", "ngram k=1", "ngram k=3", "ngram-auto", "mine"]
    assert got["ngram k=3"] == {**ngram, "num_speculative_tokens": 3}
    assert got["ngram-auto"]["num_speculative_tokens"] == "auto"  # adaptive modes keep their config
    with pytest.raises(ValueError, match="unknown mode 'baseline'"):
        modes.resolve(["baseline"])
    # A label may hold '=' (the JSON starts at the first '={'); a value that is no JSON object is refused.
    got = modes.from_flags("off", None, ['mtp k=2={"method": "mtp", "num_speculative_tokens": 2}'],
                           default=[])
    assert got["mtp k=2"] == {"method": "mtp", "num_speculative_tokens": 2}
    for bad in ("x=[1]", "x=nope", "x={1}"):
        with pytest.raises(ValueError, match="--speculative-config"):
            modes.from_flags(None, None, [bad], default=[])


def test_levels_and_request_counts() -> None:
    cfg = MatrixConfig(datasets=["copy"], levels=[])
    assert cfg.num_requests(Level(max_concurrency=32)) == 32  # one wave: a request per slot
    assert cfg.num_requests(Level(max_concurrency=1)) == 4  # single stream: at least 4 requests
    sustained = MatrixConfig(datasets=[], levels=[], prompts_per_slot=3)
    assert sustained.num_requests(Level(max_concurrency=8)) == 24
    assert cfg.num_requests(Level(request_rate=2.0)) == 120  # Poisson: fill the 60 s bound
    assert MatrixConfig(datasets=[], levels=[], num_prompts=7).num_requests(Level(max_concurrency=32)) == 7
    assert [lv.key for lv in (Level(max_concurrency=8), Level(2.5), Level(2.5, 4), Level())] == [
        "c8", "r2.5", "r2.5-c4", "all"]
    assert Level().to_json()["request_rate"] is None and math.isinf(Level().request_rate)


def test_ratios_pooled_and_per_round() -> None:
    # Two rounds where the machine ran half as fast in the second: each round's ratio is taken within
    # the round, against the best other server of that round.
    def run(label: str, rounds: list[float]) -> dict[str, Any]:
        return {"label": label, "dataset": "copy", "levels": [
            {"level": "c16", "output_throughput_tok_s": sum(rounds) / 2, "round_throughput_tok_s": rounds,
             "tpot_ms": {"p99": 10.0 * rounds[0]}}]}

    runs = [run("off", [10.0, 5.0]), run("ngram auto", [12.0, 5.0]), run("ngram k=1", [9.0, 4.0]),
            run("ngram k=2", [11.0, 6.0]), run("ngram k=4", [8.0, 4.0])]
    rows = {r["label"]: r for r in ratios(runs, "off")}
    auto = rows["ngram auto"]
    assert auto["vs_base"] == pytest.approx(8.5 / 7.5)
    assert auto["vs_best_other"] == pytest.approx(8.5 / 8.5)  # k=2 pooled: 8.5 tok/s
    assert auto["vs_best_other_rounds"] == pytest.approx([12.0 / 11.0, 5.0 / 6.0])
    assert auto["vs_base_rounds"] == pytest.approx([12.0 / 10.0, 5.0 / 5.0])
    assert auto["tpot_p99_vs_base"] == pytest.approx(1.2)
    assert rows["off"]["vs_base"] is None and rows["off"]["vs_best_other"] == pytest.approx(7.5 / 8.5)


def test_sweep_interleaves_servers_and_writes_tables(make_server: Any, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    with make_server() as off, make_server(speculative_config=NGRAM) as ngram:
        rc = main(["bench", "sweep", "--server", f"off={off.url}", "--server", f"ngram={ngram.url}",
                   "--dataset-name", "copy", "--max-concurrency", "1,2", "--rounds", "2",
                   "--num-prompts", "2", "--max-tokens", "8", "--num-warmups", "1", "--output-dir", str(out)])
        assert rc == 0 and off.idle() and ngram.idle()
    log = capsys.readouterr().out
    # Interleaved: per level and round every server once, the order alternating.
    order = [line.split("]")[1].split(":")[0].strip() for line in log.splitlines()
             if line.startswith("  [copy")]
    assert order == ["off", "ngram", "ngram", "off", "off", "ngram", "ngram", "off"]
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["kind"] == "sweep" and doc["base"] == "off" and doc["config"]["levels"] == ["c1", "c2"]
    by = {r["label"]: r for r in doc["runs"]}
    for run in by.values():
        assert [lv["level"] for lv in run["levels"]] == ["c1", "c2"]
        for lv in run["levels"]:
            assert lv["rounds"] == 2 and len(lv["round_throughput_tok_s"]) == 2
            assert lv["num_requests"] == lv["completed"] == 4 and "requests" not in lv  # 2 per round
    assert by["off"]["levels"][0]["spec_decode"] is None
    assert by["ngram"]["levels"][1]["spec_decode"]["num_draft_tokens"] > 0
    row = next(r for r in doc["ratios"] if r["label"] == "ngram" and r["level"] == "c2")
    tput = {label: by[label]["levels"][1]["output_throughput_tok_s"] for label in by}
    assert row["vs_base"] == pytest.approx(tput["ngram"] / tput["off"]) and len(row["vs_base_rounds"]) == 2
    md = (out / "results.md").read_text()
    assert "**Dataset `copy`**" in md and "| c2 | ngram | 2/2 |" not in md and "| c2 | ngram | 4/4 |" in md
    assert "Per-position acceptance (`copy`" in md and "| off | " not in md.split("Per-position")[1]
    assert (out / "copy.png").read_bytes()[:8] == PNG_SIGNATURE
    (out / "results.md").unlink()
    assert main(["bench", "sweep", "--render", str(out / "sweep.json")]) == 0
    assert (out / "results.md").read_text() == md


def test_sweep_starts_a_mode_from_its_config(server: Any, tmp_path: Path) -> None:
    """`--modes ngram` starts a real `specserve serve` process with configs/ngram.yaml's speculative
    config, beside a running server given by URL."""
    out = tmp_path / "sweep"
    rc = main(["bench", "sweep", "--modes", "ngram", "--server", f"off={server.url}",
               "--dataset-name", "copy", "--max-concurrency", "1", "--num-prompts", "1",
               "--max-tokens", "24", "--num-warmups", "0", "--output-dir", str(out)])
    assert rc == 0 and server.idle()
    doc = json.loads((out / "sweep.json").read_text())
    started = next(r for r in doc["runs"] if r["label"] == "ngram")
    cmd = started["command"]
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == modes.speculative_config("ngram")
    assert started["levels"][0]["completed"] == 1 and started["levels"][0]["spec_decode"]["num_drafts"] > 0
    assert "serving on http://127.0.0.1" in (out / "logs" / "ngram.log").read_text()


def test_server_values() -> None:
    spec = server_spec("tuned", "SPECSERVE_MALLOC=default OMP_NUM_THREADS=2 specserve serve --port {port}")
    assert spec.env == {"SPECSERVE_MALLOC": "default", "OMP_NUM_THREADS": "2"}
    assert spec.command == ["specserve", "serve", "--port", "{port}"] and spec.url is None
    remote = server_spec("vllm", "http://10.0.0.2:8000/")
    assert remote.url == "http://10.0.0.2:8000" and remote.command is None
    with pytest.raises(ValueError, match="no command"):
        server_spec("x", "A=1")


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
