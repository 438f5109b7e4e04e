"""Replicas on Ray Serve, end to end: a local Ray cluster, `specserve serve --replicas 2` started through
the CLI against it, the real default model in each replica. Slow (a cluster and two engines start):
run with `-m slow`; CI runs this file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loadtests.servers import free_port
from tests.helpers import wait_healthy

# Ray's token authentication for the `ray start` cluster, this driver and the CLI's (read at import). Ray
# 2.60's `ray start` no longer makes a token itself: this run's own, as `ray get-auth-token --generate` makes.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
ray = pytest.importorskip("ray", reason="the `ray` extra (Ray Serve) is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

API_KEY = "replica-key"
RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")


@dataclass
class Cluster:
    address: str
    http_port: int  # Serve's proxy keeps the port the first application started it with


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    port = free_port()
    subprocess.run([RAY_BIN, "start", "--head", f"--port={port}", "--num-cpus=8", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, capture_output=True, timeout=120)
    c = Cluster(address=f"127.0.0.1:{port}", http_port=free_port())
    ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        subprocess.run([RAY_BIN, "stop", "--force"], capture_output=True, timeout=120)


@contextlib.contextmanager
def specserve(cluster: Cluster, *flags: str) -> Iterator[str]:
    port = cluster.http_port
    log = open(f"/tmp/specserve-replicas-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--replicas", "2", "--port", str(port),
         "--ray-address", cluster.address, "--max-model-len", "2048", "--kv-cache-memory", "256MiB",
         "--api-key", API_KEY, "--log-stats-interval", "0", *flags],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, Path(log.name))
        _wait_replicas(2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _engine_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if "EngineReplica" in a["name"]]


def _wait_replicas(n: int, timeout: float = 300) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get("specserve")
        if status is not None:
            dep = status.deployments["EngineReplica"]
            if dep.status == "HEALTHY" and dep.replica_states.get("RUNNING", 0) == n:
                return
        time.sleep(1)
    raise AssertionError(f"EngineReplica did not reach {n} running replicas: {serve.status()}")


HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _series_sum(url: str, prefix: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def _running(url: str) -> float:
    return _series_sum(url, "vllm:num_requests_running{")


def _aborted(url: str) -> float:
    return _series_sum(url, 'vllm:request_success_total{finished_reason="abort"')


def _conversations(url: str, n: int) -> list[int]:
    """n two-turn conversations, each with its own first block; the follow-up turns' cached tokens."""
    first = []
    with httpx.Client(base_url=url, headers=HEADERS, timeout=120) as http:
        for i in range(n):
            msgs = [{"role": "system", "content": f"Conversation {i}. You are a terse assistant; answer in a "
                                                  f"few words and keep every detail of session {i} in mind."},
                    {"role": "user", "content": f"Name a colour for item {i}."}]
            r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            first.append((msgs, r.json()["choices"][0]["message"]["content"]))
        cached = []
        for msgs, reply in first:
            follow = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
            r = http.post("/v1/chat/completions",
                          json={"messages": follow, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return cached


def test_openai_sdk_core_cases_through_replicas(cluster: Cluster) -> None:
    from openai import AuthenticationError, NotFoundError, OpenAI

    with specserve(cluster) as url:
        client = OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        models = client.models.list()
        assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
        chat = client.chat.completions.create(model=models.data[0].id, max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": "Say hello."}])
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
        parts = list(client.chat.completions.create(
            model=models.data[0].id, max_tokens=8, temperature=0, stream=True,
            messages=[{"role": "user", "content": "Say hello."}]))
        streamed = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        assert streamed == chat.choices[0].message.content  # greedy: the same text, whichever replica
        comp = client.completions.create(model=models.data[0].id, prompt="1, 2, 3,", max_tokens=6,
                                         temperature=0)
        assert comp.choices[0].text and comp.usage.completion_tokens == 6
        with pytest.raises(NotFoundError) as e:
            client.chat.completions.create(model="nope", max_tokens=2,
                                           messages=[{"role": "user", "content": "x"}])
        assert e.value.body["code"] == "model_not_found"  # the replica's own OpenAI error body
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        # The body limit holds at the ingress too: the replica's guard answers 413.
        r = httpx.post(url + "/v1/completions", headers=HEADERS, content=b"x" * (3 * 2**20),
                       timeout=60)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        # One exposition, each replica's series under its own label.
        deadline = time.monotonic() + 20  # each replica pushes its exposition every second
        while True:
            text = httpx.get(url + "/metrics", timeout=30).text
            replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                        if line.startswith("vllm:num_requests_running{")}
            if len(replicas) == 2 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert len(replicas) == 2, text[:2000]

        # A client that leaves (before the response starts, or mid-stream) aborts its engine request.
        long = {"messages": [{"role": "user", "content": "Tell a very long story."}], "max_tokens": 1900,
                "ignore_eos": True}
        aborted = _aborted(url)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", headers=HEADERS, json=long, timeout=2)
        with httpx.stream("POST", url + "/v1/chat/completions", headers=HEADERS,
                          json={**long, "stream": True}, timeout=60) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 20  # replicas push their series every 5 s
        while _aborted(url) < aborted + 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _aborted(url) == aborted + 2  # finished as aborted, not run to their length
        assert _running(url) == 0

        # Prefix-aware routing: a follow-up turn lands where its first turn's KV blocks are.
        cached = _conversations(url, 40)
        hits = sum(c > 0 for c in cached)
        print(f"prefix-aware routing: {hits}/40 follow-ups hit their first turn's cache")
        assert hits >= 38, f"{hits}/40 follow-ups hit their first turn's cache: {cached}"


def test_default_router_scatters_follow_ups(cluster: Cluster) -> None:
    """What prefix-aware routing is for: with Serve's own router, follow-ups find their cache by chance."""
    with specserve(cluster, "--replica-routing", "power-of-two") as url:
        cached = _conversations(url, 40)
    hits = sum(c > 0 for c in cached)
    print(f"power-of-two routing: {hits}/40 follow-ups hit their first turn's cache")
    assert hits <= 32, f"{hits}/40 follow-ups hit without prefix routing: the test cannot tell routers apart"


async def _load(url: str, n: int) -> list[tuple[int, str, str | None]]:
    async def one(i: int, http: httpx.AsyncClient) -> tuple[int, str, str | None]:
        body = {"messages": [{"role": "user", "content": f"Write a long story about robot number {i}."}],
                "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": i % 2 == 0}
        try:
            r = await http.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            return -1, repr(e), None
        return r.status_code, r.text, r.headers.get("retry-after")

    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=300) as http:
        return await asyncio.gather(*(one(i, http) for i in range(n)))


def test_a_replica_killed_mid_load_loses_no_request_silently(cluster: Cluster) -> None:
    import threading

    with specserve(cluster) as url:
        results: list[tuple[int, str, str | None]] = []
        loader = threading.Thread(target=lambda: results.extend(asyncio.run(_load(url, 16))))
        loader.start()
        time.sleep(5)  # the requests are running on both replicas (each needs well over 10 s)
        victim = ray.get_actor(_engine_actors()[0], namespace="serve")
        pid = ray.get(victim.__ray_call__.remote(lambda _self: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        loader.join(600)
        assert not loader.is_alive() and len(results) == 16
        outcomes = {"done": 0, "503": 0, "stream error": 0}
        for status, text, retry_after in results:
            if status == 503:
                assert retry_after is not None and '"replica_unavailable"' in text, text
                outcomes["503"] += 1
            elif status == 200 and '"replica_unavailable"' in text and "[DONE]" not in text:
                outcomes["stream error"] += 1  # the stream had started: it ends with an error event
            else:
                assert status == 200 and ('"finish_reason":"length"' in text.replace(" ", "")), (status,
                                                                                               text[-500:])
                outcomes["done"] += 1
        print(f"killed a replica mid-load: {outcomes}")
        assert outcomes["503"] + outcomes["stream error"] > 0, outcomes  # the victim held some of them
        assert outcomes["done"] > 0, outcomes
        _wait_replicas(2)  # Serve replaced it
        r = httpx.post(url + "/v1/chat/completions", headers=HEADERS, timeout=120,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200
