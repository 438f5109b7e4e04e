"""One model over 2 ranks (mx.distributed, ring backend on localhost), end to end: `specserve serve
--tensor-parallel-size 2` started through the CLI, the real default model split over both ranks. Slow (two
ranks load the model per server): run with `-m slow`; CI runs this file."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.llm import LLM
from engine.sampling import SamplingParams
from loadtests.servers import free_port
from tests.helpers import wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 40
PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the "
    "lazy dog.",
    "List three primary colors, one per line.",
    "Explain in two sentences why the sky is blue.",
    "Copy this list: apples, pears, plums, apples, pears, plums, apples, pears, plums.",
]
NEAR_TIE = 1e-3  # a top-2 logprob gap below this may flip with the all-sum's summation order


@contextlib.contextmanager
def tp_server(*flags: str, expect_status: int | None = 0) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    log = open(f"/tmp/specserve-tp-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--tensor-parallel-size", "2", "--port", str(port),
         "--max-model-len", "2048", "--kv-cache-memory", "256MiB", "--log-stats-interval", "0", *flags],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, Path(log.name))
        yield url, proc
        if expect_status is not None:
            ranks = _ranks(proc.pid)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == expect_status, Path(log.name).read_text()[-3000:]
            for pid in ranks:  # every rank ended with the supervisor
                assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"rank {pid} outlived the stop"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _ranks(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()


def _ranks(parent: int) -> dict[int, int]:
    """pid -> MLX_RANK of the rank processes under the supervisor (children, or the launcher's)."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    children: dict[int, list[int]] = {}
    for pid, ppid in zip(map(int, table[::2]), map(int, table[1::2]), strict=True):
        children.setdefault(ppid, []).append(pid)
    todo, ranks = list(children.get(parent, [])), {}
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"MLX_RANK=")), None)
            if rank is not None and Path(f"/proc/{pid}/cmdline").read_bytes().find(b"server.cli") >= 0:
                ranks[pid] = int(rank)
    return ranks


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    return True


@pytest.fixture(scope="module")
def reference() -> tuple[LLM, list[list[int]], list]:
    """One rank, the same weights (the GGUF as stored): prompt ids, and outputs with top-2 logprobs."""
    llm = LLM(kv_cache_memory="256MiB", max_model_len=2048, show_progress=False)
    ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2))
    return llm, ids, outs


def _complete_all(url: str, ids: list[list[int]]) -> list[str]:
    """Every prompt at once (one batched step after another), greedy."""
    def one(prompt: list[int]) -> str:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
        return list(pool.map(one, ids))


def _divergence(llm: LLM, ref: object, text: str) -> tuple[int, float]:
    """(token position where `text` leaves the reference's output, the reference's top-2 logprob gap
    there)."""
    ids = ref.token_ids  # type: ignore[attr-defined]
    pos = 0
    while pos < len(ids) and text.startswith(llm.tokenizer.decode(ids[: pos + 1])):
        pos += 1
    top = ref.logprobs[pos].top  # type: ignore[attr-defined]
    return pos, top[0][1] - top[1][1]


def _accepted_drafts(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)",
                                            text, re.M))


def test_two_ranks_serve_what_one_rank_serves_and_ngram_changes_nothing(reference: tuple) -> None:
    llm, ids, outs = reference
    with tp_server() as (url, _):
        # The openai SDK's path too: a chat completion through rank 0's server.
        from openai import OpenAI

        chat = OpenAI(base_url=url + "/v1", api_key="none").chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": PROMPTS[1]}],
            max_tokens=MAX_TOKENS, temperature=0)
        assert chat.choices[0].message.content == outs[1].text
        alone = _complete_all(url, ids[:1])
        batched = _complete_all(url, ids)
    assert alone[0] == batched[0]
    for i, (text, ref) in enumerate(zip(batched, outs, strict=True)):
        if text != ref.text:
            pos, gap = _divergence(llm, ref, text)
            assert gap < NEAR_TIE, f"prompt {i}: 2 ranks left 1 rank's output at token {pos} (gap {gap:.4f})"
    with tp_server("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}') as (url, _):
        speculated = _complete_all(url, ids)
        assert _accepted_drafts(url) > 0  # drafts were made and verified over both ranks
    assert speculated == batched
    # A draft model runs whole on rank 0 (the target as its own draft: an unsharded copy).
    draft = '{"method": "draft_model", "model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 3}'
    with tp_server("--speculative-config", draft) as (url, _):
        drafted = _complete_all(url, ids[1:3])
        assert _accepted_drafts(url) > 0
    assert drafted == batched[1:3]


def test_ranks_from_a_hostfile_through_mlx_launch(reference: tuple, tmp_path: Path) -> None:
    """The several-machines path (MLX's launcher and hostfile), with both hosts this one."""
    _, ids, outs = reference
    hostfile = tmp_path / "hosts.json"
    host = {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [host, host]}))
    with tp_server("--hostfile", str(hostfile)) as (url, _):
        assert _complete_all(url, ids[1:2]) == [outs[1].text]


def test_a_rank_that_dies_stops_the_server_with_an_error(reference: tuple) -> None:
    _, ids, _ = reference
    with tp_server(expect_status=None) as (url, proc):
        follower = next(pid for pid, rank in _ranks(proc.pid).items() if rank == 1)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(httpx.post, url + "/v1/completions", timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "prompt": p, "max_tokens": 200, "temperature": 0})
                for p in ids[:4]]
            time.sleep(1.0)
            os.kill(follower, signal.SIGKILL)
            for f in futures:  # each request ends (an error or a response), none hangs
                with contextlib.suppress(httpx.HTTPError):
                    r = f.result(timeout=120)
                    assert r.status_code in (200, 500, 503), r.text
        status = proc.wait(120)
        assert status != 0
        assert not [pid for pid in _ranks(proc.pid) if not _zombie(pid)]
