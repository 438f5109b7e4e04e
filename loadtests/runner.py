"""Drive one server at one load level and summarise it.

A level is vLLM's pair: requests arrive at `request_rate` per second (Poisson; infinite: all at once)
and at most `max_concurrency` are in flight; a sweep's level may also fix every request's temperature
(`bench sweep --temperatures`). It is bounded twice: by a request count and by a time
limit (no new request starts after it; those in flight finish, their length bounded by max_tokens).
Spec-decode counters are read from `/metrics` before and after, so acceptance covers exactly this
level's requests.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from loadtests.client import RequestOptions, RequestResult, stream_request
from loadtests.datasets import WorkItem, at_temperature
from loadtests.prom import acceptance_summary, merge_spec, scrape

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class Level:
    request_rate: float = math.inf  # mean arrivals per second (Poisson); inf: all at once
    max_concurrency: int | None = None  # most requests in flight; None: no limit
    temperature: float | None = None  # every request at this temperature; None: each item's own

    @property
    def load_key(self) -> str:
        """The load alone: "c8", "r2.5", "r2.5-c4" or "all"."""
        parts = [] if math.isinf(self.request_rate) else [f"r{self.request_rate:g}"]
        if self.max_concurrency is not None:
            parts.append(f"c{self.max_concurrency}")
        return "-".join(parts) or "all"

    @property
    def key(self) -> str:
        """The load, and the temperature where the level fixes one: "c8", "c8-t0.4"."""
        return self.load_key + ("" if self.temperature is None else f"-t{self.temperature:g}")

    @property
    def x(self) -> float:
        """Where the level sits on a plot's load axis: the concurrency, or the rate when it has one."""
        if math.isinf(self.request_rate):
            return float(self.max_concurrency or 0)
        return self.request_rate

    def to_json(self) -> dict[str, Any]:
        rate = None if math.isinf(self.request_rate) else self.request_rate  # JSON has no infinity
        return {"level": self.key, "request_rate": rate, "max_concurrency": self.max_concurrency,
                "temperature": self.temperature}


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * p / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dist_ms(seconds: list[float]) -> dict[str, float | None]:
    """Mean and percentiles, in milliseconds, of durations given in seconds."""
    ms = [v * 1000 for v in seconds]
    out: dict[str, float | None] = {"mean": sum(ms) / len(ms) if ms else None}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ms, p)
    return out


def _counts(records: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """Counts, throughput over `duration` and latency distributions of some requests."""
    ok = [r for r in records if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "output_tokens": out_tokens,
        "output_throughput_tok_s": out_tokens / duration if duration > 0 else None,
        "ttft_ms": dist_ms([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_ms": dist_ms([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_ms": dist_ms([x for r in ok for x in r["itl"]]),
        "e2e_ms": dist_ms([r["e2e"] for r in ok if r["e2e"] is not None]),
    }


def summarize(records: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """Summary of `RequestResult.to_json()` records measured over `duration` seconds of wall time. Where
    requests carry a class, "classes" holds the same counts and latencies per class (a class's tokens/s
    is its tokens over the whole duration: the classes add up to the total)."""
    ok = [r for r in records if r["ok"]]
    summary: dict[str, Any] = {
        **_counts(records, duration),
        "duration_s": duration,
        "input_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "request_throughput_rps": len(ok) / duration if duration > 0 else None,
        "usage_reported": all(r["usage_reported"] for r in ok) if ok else None,
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "retries": sum(r.get("retries", 0) for r in records),
    }
    classes = sorted({c for r in records if (c := r.get("request_class")) is not None})
    if classes:  # requests without a class count in the totals only
        summary["classes"] = {c: _counts([r for r in records if r.get("request_class") == c], duration)
                              for c in classes}
    return summary


def make_client(max_connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=max_connections + 4,
                                                 max_keepalive_connections=max_connections + 4),
                             timeout=httpx.Timeout(600.0, connect=30.0))


async def _drive(client: httpx.AsyncClient, url: str, items: list[WorkItem], opts: RequestOptions,
                 level: Level, n: int, deadline: float, offset: int, t0: float, seed: int,
                 bar: tqdm | None) -> list[RequestResult]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None

    async def one(item: WorkItem) -> RequestResult | None:
        if sem is None:
            res = await stream_request(client, url, item, opts, t0)
        else:
            async with sem:
                if time.perf_counter() >= deadline:  # queued past the time bound: never sent
                    return None
                res = await stream_request(client, url, item, opts, t0)
        if bar is not None:
            bar.update(1)
        return res

    tasks = []
    at = t0
    for i in range(n):
        if not math.isinf(level.request_rate):
            at += rng.expovariate(level.request_rate)
            if at >= deadline:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(one(items[(offset + i) % len(items)])))
    return [r for r in await asyncio.gather(*tasks) if r is not None]


async def warm_up(url: str, items: list[WorkItem], opts: RequestOptions, n: int = 2) -> None:
    """A few unmeasured requests: first-call costs (graph building, allocation) stay out of the data."""
    async with make_client(2) as client:
        for i in range(n):
            await stream_request(client, url, items[i % len(items)], opts, time.perf_counter())


async def run_level(url: str, items: list[WorkItem], opts: RequestOptions, level: Level, num_requests: int,
                    duration_s: float = math.inf, offset: int = 0, seed: int = 0,
                    bar: tqdm | None = None) -> dict[str, Any]:
    """Drive one level; `seed` seeds the arrivals and, at a level's temperature, each item's sampling."""
    if level.temperature is not None:
        items = [at_temperature(it, level.temperature, seed) for it in items]
    async with make_client(level.max_concurrency or min(num_requests, 256)) as client:
        before = await scrape(client, url)
        t0 = time.perf_counter()
        results = await _drive(client, url, items, opts, level, num_requests, t0 + duration_s, offset, t0,
                               seed, bar)
        duration = time.perf_counter() - t0
        after = await scrape(client, url)
    delta = after.minus(before) if after is not None and before is not None else after
    records = [r.to_json() for r in sorted(results, key=lambda r: r.start)]
    return {**level.to_json(), **summarize(records, duration), "spec_decode": acceptance_summary(delta),
            "requests": records}


def merge_levels(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from several measurements of the same level (interleaved rounds): requests pooled,
    durations added, acceptance counts added, each round's throughput kept."""
    records = [r for p in parts for r in p["requests"]]
    specs = [p["spec_decode"] for p in parts if p.get("spec_decode")]
    head = {k: parts[0].get(k) for k in ("level", "request_rate", "max_concurrency", "temperature")}
    return {**head, **summarize(records, sum(p["duration_s"] for p in parts)),
            "spec_decode": merge_spec(specs) if specs else None, "rounds": len(parts),
            "round_throughput_tok_s": [p["output_throughput_tok_s"] for p in parts],
            "server_minor_faults": sum_known([p.get("server_minor_faults") for p in parts]),
            "requests": records}


def sum_known(values: list[int | None]) -> int | None:
    """The sum, or None where any part is unknown (a remote server's page faults cannot be read)."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)
