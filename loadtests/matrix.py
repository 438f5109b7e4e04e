"""Run the same workloads and levels against several servers, interleaved.

On a shared, noisy machine the order matters more than the repeat count: for every level each server
runs once per round, and the order alternates between rounds (A B C, C B A, ...) so slow drift in
background load hits every server alike. Servers are all started first and stay up (idle) while the
others are measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loadtests.client import RequestOptions
from loadtests.runner import Level, merge_levels, run_level, warm_up
from loadtests.servers import ServerProcess, ServerSpec
from loadtests.workloads import load_workload


@dataclass
class MatrixConfig:
    workloads: list[str]
    levels: list[Level]
    max_tokens: int = 64
    endpoint: str = "chat"
    ignore_eos: bool = False
    requests_per_slot: int = 2  # requests per level = max(min_requests, this * concurrency)
    min_requests: int = 4
    max_requests: int | None = None
    duration_s: float = 60.0  # per level and round: no new request after this
    rounds: int = 1
    warmup: int = 2
    seed: int = 0
    greedy_fraction: float = 0.5
    extra_body: dict[str, Any] = field(default_factory=dict)

    def num_requests(self, level: Level) -> int:
        if level.concurrency is not None:
            n = max(self.min_requests, self.requests_per_slot * level.concurrency)
        else:  # Poisson: enough arrivals to fill the time bound
            n = max(self.min_requests, math.ceil((level.qps or 1.0) * self.duration_s))
        return min(n, self.max_requests) if self.max_requests else n

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "levels"}
        return {**d, "levels": [lvl.key for lvl in self.levels]}


@contextlib.contextmanager
def started(specs: list[ServerSpec], log_dir: Path, say: Callable[[str], None] | None = None,
            ) -> Iterator[tuple[list[ServerProcess], list[dict[str, Any]]]]:
    """Start every server one after the other (start-up is CPU-heavy); yield (up, unavailable)."""
    say = say or _say
    up: list[ServerProcess] = []
    down: list[dict[str, Any]] = []
    try:
        for spec in specs:
            srv = ServerProcess(spec, log_dir / f"{_slug(spec.label)}.log")
            say(f"starting {spec.label} ...")
            if srv.start():
                say(f"  {spec.label}: {srv.url} (ready in {srv.startup_s or 0:.1f} s)")
                up.append(srv)
            else:
                say(f"  {spec.label}: NOT AVAILABLE: {srv.error}")
                down.append({"label": spec.label, "error": srv.error, "command": spec.command})
        yield up, down
    finally:
        for srv in up:
            srv.stop()


def _say(msg: str) -> None:
    print(msg, flush=True)  # progress must show up promptly when stdout is a file


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def run_matrix(servers: list[ServerProcess], cfg: MatrixConfig,
               say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """-> runs: [{"label", "workload", "url", "levels": [merged level summaries]}] (server-major)."""
    return asyncio.run(_run_matrix(servers, cfg, say or _say))


async def _run_matrix(servers: list[ServerProcess], cfg: MatrixConfig,
                      say: Callable[[str], None]) -> list[dict[str, Any]]:
    opts = {s.spec.label: RequestOptions(endpoint=cfg.endpoint, model=s.spec.model, max_tokens=cfg.max_tokens,
                                         ignore_eos=cfg.ignore_eos, extra_body=cfg.extra_body)
            for s in servers}
    parts: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    flip = 0
    for wl in cfg.workloads:
        items = load_workload(wl, seed=cfg.seed, greedy_fraction=cfg.greedy_fraction)
        for srv in servers:  # warm-up per workload: prompt shapes differ between workloads
            await warm_up(srv.url, items, replace(opts[srv.spec.label], max_tokens=8), cfg.warmup)
        offset = 0
        for level in cfg.levels:
            n = cfg.num_requests(level)
            for rnd in range(cfg.rounds):
                order = servers if flip % 2 == 0 else servers[::-1]
                flip += 1
                for srv in order:
                    t0, f0 = time.monotonic(), srv.minor_faults()
                    # Same offset on every server: each sees the same prompts in the same order.
                    res = await run_level(srv.url, items, opts[srv.spec.label], level, n, cfg.duration_s,
                                          offset=offset + rnd * n, seed=cfg.seed + rnd)
                    f1 = srv.minor_faults()
                    res["server_minor_faults"] = f1 - f0 if f0 is not None and f1 is not None else None
                    parts.setdefault((srv.spec.label, wl, level.key), []).append(res)
                    say(_progress(srv.spec.label, wl, level, rnd, res, time.monotonic() - t0))
            offset += n * cfg.rounds
    runs = []
    for srv in servers:
        for wl in cfg.workloads:
            levels = [merge_levels(parts[(srv.spec.label, wl, lvl.key)]) for lvl in cfg.levels]
            runs.append({"label": srv.spec.label, "workload": wl, "url": srv.url,
                         "command": srv.cmd,
                         "notes": srv.spec.notes, "levels": levels})
    return runs


def _progress(label: str, wl: str, level: Level, rnd: int, res: dict[str, Any], wall: float) -> str:
    tp = res["output_throughput_tok_s"] or 0.0
    p99 = res["tpot_s"]["p99"]
    acc = (res.get("spec_decode") or {}).get("acceptance_rate")
    faults = res.get("server_minor_faults")
    churn = faults is not None and faults > 10_000 * wall  # engine/malloc.py: a sick process, not a result
    return (f"  [{wl} {level.key} r{rnd}] {label:>16}: {res['completed']}/{res['num_requests']} ok, "
            f"{tp:6.1f} tok/s, TPOT p99 {p99 * 1000 if p99 else float('nan'):6.0f} ms"
            + (f", acceptance {acc:.2f}" if acc is not None else "") + f" ({wall:.0f} s)"
            + (f" [{faults / wall:,.0f} page faults/s: malloc churn]" if churn else ""))


def ratios(runs: list[dict[str, Any]], base: str, other: str) -> list[dict[str, Any]]:
    """other / base per workload and level, for throughput and latency percentiles."""
    idx = {(r["label"], r["workload"]): r for r in runs}
    out = []
    for (label, wl), run_b in idx.items():
        if label != base or (other, wl) not in idx:
            continue
        for lb, lo in zip(run_b["levels"], idx[(other, wl)]["levels"], strict=True):
            row: dict[str, Any] = {"workload": wl, "level": lb["level"]}
            for key, sub in (("output_throughput_tok_s", None), ("ttft_s", "p50"), ("ttft_s", "p99"),
                             ("tpot_s", "p50"), ("tpot_s", "p99"), ("e2e_s", "p50"), ("e2e_s", "p99")):
                vb = lb[key] if sub is None else lb[key][sub]
                vo = lo[key] if sub is None else lo[key][sub]
                name = key if sub is None else f"{key}_{sub}"
                row[name] = vo / vb if vb and vo is not None else None
            out.append(row)
    return out
