"""Drive one server at one load level (fixed concurrency or Poisson arrivals) and summarise it.

A level is bounded twice: by a request count and by a time limit (no new request starts after it;
those in flight finish, their length being bounded by max_tokens). Spec-decode counters are read from
`/metrics` before and after, so acceptance covers exactly this level's requests.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from loadtests.client import RequestOptions, RequestResult, stream_request
from loadtests.prom import acceptance_summary, merge_spec, scrape
from loadtests.workloads import WorkItem

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class Level:
    concurrency: int | None = None  # fixed number of requests in flight
    qps: float | None = None  # Poisson arrivals at this mean rate
    max_concurrency: int | None = None  # optional cap on in-flight requests for Poisson

    @property
    def key(self) -> str:
        return f"c{self.concurrency}" if self.concurrency is not None else f"qps{self.qps:g}"

    @property
    def x(self) -> float:
        return float(self.concurrency if self.concurrency is not None else self.qps or 0.0)


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * p / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dist(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p)
    return out


def summarize(records: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """Summary of `RequestResult.to_json()` records measured over `duration` seconds of wall time."""
    ok = [r for r in records if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "output_throughput_tok_s": out_tokens / duration if duration > 0 else None,
        "request_throughput_rps": len(ok) / duration if duration > 0 else None,
        "usage_reported": all(r["usage_reported"] for r in ok) if ok else None,
        "ttft_s": dist([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_s": dist([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_s": dist([x for r in ok for x in r["itl"]]),
        "e2e_s": dist([r["e2e"] for r in ok if r["e2e"] is not None]),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "retries": sum(r.get("retries", 0) for r in records),
    }
    greedy = [r["tpot"] for r in ok if r["temperature"] == 0 and r["tpot"] is not None]
    sampled = [r["tpot"] for r in ok if r["temperature"] > 0 and r["tpot"] is not None]
    if greedy and sampled:  # mixed-temperature workloads: where speculation costs the sampled ones
        summary["tpot_s_greedy"] = dist(greedy)
        summary["tpot_s_sampled"] = dist(sampled)
    return summary


def make_client(max_connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=max_connections + 4,
                                                 max_keepalive_connections=max_connections + 4),
                             timeout=httpx.Timeout(600.0, connect=30.0))


async def _concurrency(client: httpx.AsyncClient, url: str, items: list[WorkItem], opts: RequestOptions,
                       n: int, deadline: float, offset: int, t0: float,
                       concurrency: int) -> list[RequestResult]:
    results: list[RequestResult] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:  # shared iterator: each index is taken by exactly one worker
            if time.perf_counter() >= deadline:
                return
            results.append(await stream_request(client, url, items[(offset + i) % len(items)], opts, t0))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def _poisson(client: httpx.AsyncClient, url: str, items: list[WorkItem], opts: RequestOptions,
                   n: int, deadline: float, offset: int, t0: float, qps: float, cap: int | None,
                   seed: int) -> list[RequestResult]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(cap) if cap else None
    tasks = []

    async def one(item: WorkItem) -> RequestResult:
        if sem is None:
            return await stream_request(client, url, item, opts, t0)
        async with sem:
            return await stream_request(client, url, item, opts, t0)

    at = t0
    for i in range(n):
        at += rng.expovariate(qps)
        if at >= deadline:
            break
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(items[(offset + i) % len(items)])))
    return list(await asyncio.gather(*tasks))


async def warm_up(url: str, items: list[WorkItem], opts: RequestOptions, n: int = 2) -> None:
    """A few unmeasured requests: first-call costs (graph building, allocation) stay out of the data."""
    async with make_client(2) as client:
        for i in range(n):
            await stream_request(client, url, items[i % len(items)], opts, time.perf_counter())


async def run_level(url: str, items: list[WorkItem], opts: RequestOptions, level: Level, num_requests: int,
                    duration_s: float, offset: int = 0, seed: int = 0) -> dict[str, Any]:
    width = level.concurrency or level.max_concurrency or max(8, int((level.qps or 1) * 8))
    async with make_client(width) as client:
        before = await scrape(client, url)
        t0 = time.perf_counter()
        deadline = t0 + duration_s
        if level.concurrency is not None:
            results = await _concurrency(client, url, items, opts, num_requests, deadline, offset, t0,
                                         level.concurrency)
        else:
            assert level.qps is not None and level.qps > 0
            results = await _poisson(client, url, items, opts, num_requests, deadline, offset, t0, level.qps,
                                     level.max_concurrency, seed)
        duration = time.perf_counter() - t0
        after = await scrape(client, url)
    delta = after.minus(before) if after is not None and before is not None else after
    records = [r.to_json() for r in sorted(results, key=lambda r: r.start)]
    return {"level": level.key, "concurrency": level.concurrency, "qps": level.qps,
            **summarize(records, duration), "spec_decode": acceptance_summary(delta), "requests": records}


def merge_levels(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from several measurements of the same level (interleaved rounds): requests pooled,
    durations added, acceptance counts added."""
    if len(parts) == 1:
        return parts[0]
    records = [r for p in parts for r in p["requests"]]
    specs = [p["spec_decode"] for p in parts if p.get("spec_decode")]
    return {"level": parts[0]["level"], "concurrency": parts[0]["concurrency"], "qps": parts[0]["qps"],
            **summarize(records, sum(p["duration_s"] for p in parts)),
            "spec_decode": merge_spec(specs) if specs else None, "rounds": len(parts),
            "round_throughput_tok_s": [p["output_throughput_tok_s"] for p in parts],
            "server_minor_faults": sum_known([p.get("server_minor_faults") for p in parts]),
            "requests": records}


def sum_known(values: list[int | None]) -> int | None:
    """The sum, or None where any part is unknown (a remote server's page faults cannot be read)."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def run_level_sync(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(run_level(*args, **kwargs))
