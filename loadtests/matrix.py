"""Run the same datasets and levels against several servers, interleaved (`bench sweep`).

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from loadtests.client import RequestOptions, resolve_model
from loadtests.datasets import DatasetOptions, at_temperature, load_dataset
from loadtests.report import slug
from loadtests.runner import Level, merge_levels, run_level, warm_up
from loadtests.servers import ServerProcess, ServerSpec


@dataclass
class MatrixConfig:
    datasets: list[str]
    levels: list[Level]
    request: RequestOptions = field(default_factory=RequestOptions)  # model: per server
    data: DatasetOptions = field(default_factory=DatasetOptions)
    prompts_per_slot: int = 1  # requests per level = max(min_requests, this * max_concurrency)
    min_requests: int = 4
    num_prompts: int | None = None  # a fixed count per level instead
    duration_s: float = 60.0  # per level and round: no new request after this
    rounds: int = 1
    warmup: int = 2

    def num_requests(self, level: Level) -> int:
        if self.num_prompts:
            return self.num_prompts
        if math.isinf(level.request_rate):
            slots = level.max_concurrency or self.min_requests
            return max(self.min_requests, self.prompts_per_slot * slots)
        return max(self.min_requests, math.ceil(level.request_rate * self.duration_s))  # fill the time bound

    def to_json(self) -> dict[str, Any]:
        request = {k: v for k, v in asdict(self.request).items() if k not in ("model", "api_key")}
        return {"datasets": self.datasets, "levels": [lvl.key for lvl in self.levels],
                "temperatures": list(dict.fromkeys(lvl.temperature for lvl in self.levels)),
                "request": request,
                "data": asdict(self.data), "prompts_per_slot": self.prompts_per_slot,
                "min_requests": self.min_requests, "num_prompts": self.num_prompts,
                "duration_s": self.duration_s, "rounds": self.rounds, "warmup": self.warmup}


@contextlib.contextmanager
def started(specs: list[ServerSpec], log_dir: Path, say: Callable[[str], None] | None = None,
            ) -> Iterator[tuple[list[ServerProcess], list[dict[str, Any]]]]:
    """Start every server one after the other (start-up is CPU-heavy); yield (up, unavailable)."""
    say = say or _say
    up: list[ServerProcess] = []
    down: list[dict[str, Any]] = []
    try:
        for spec in specs:
            srv = ServerProcess(spec, log_dir / f"{slug(spec.label)}.log")
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


def run_matrix(servers: list[ServerProcess], cfg: MatrixConfig,
               say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """-> runs: [{"label", "dataset", "url", "levels": [merged level summaries]}] (server-major)."""
    return asyncio.run(_run_matrix(servers, cfg, say or _say))


async def _run_matrix(servers: list[ServerProcess], cfg: MatrixConfig,
                      say: Callable[[str], None]) -> list[dict[str, Any]]:
    opts = {s.spec.label: replace(cfg.request,
                                  model=s.spec.model or resolve_model(s.url, cfg.request.api_key))
            for s in servers}
    parts: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    flip = 0
    for ds in cfg.datasets:
        items = load_dataset(ds, cfg.data)
        # A sampled warm-up too where levels sample: the sampling path's first calls stay out of the data.
        hot = max((lvl.temperature or 0.0 for lvl in cfg.levels), default=0.0)
        warm = [items, [at_temperature(it, hot, cfg.data.seed) for it in items]] if hot > 0 else [items]
        for srv in servers:  # warm-up per dataset: prompt shapes differ between datasets
            for its in warm:
                await warm_up(srv.url, its, replace(opts[srv.spec.label], max_tokens=8), cfg.warmup)
        offsets: dict[str, int] = {}
        next_offset = 0
        for level in cfg.levels:
            n = cfg.num_requests(level)
            # Every temperature of a load level gets the same prompts: acceptance then compares like
            # with like across temperatures (each load level its own, as before).
            if level.load_key not in offsets:
                offsets[level.load_key] = next_offset
                next_offset += n * cfg.rounds
            offset = offsets[level.load_key]
            for rnd in range(cfg.rounds):
                order = servers if flip % 2 == 0 else servers[::-1]
                flip += 1
                for srv in order:
                    t0, f0 = time.monotonic(), srv.minor_faults()
                    # Same offset on every server: each sees the same prompts in the same order.
                    res = await run_level(srv.url, items, opts[srv.spec.label], level, n, cfg.duration_s,
                                          offset=offset + rnd * n, seed=cfg.data.seed + rnd)
                    f1 = srv.minor_faults()
                    res["server_minor_faults"] = f1 - f0 if f0 is not None and f1 is not None else None
                    parts.setdefault((srv.spec.label, ds, level.key), []).append(res)
                    say(_progress(srv.spec.label, ds, level, rnd, res, time.monotonic() - t0))
    runs = []
    for srv in servers:
        for ds in cfg.datasets:
            levels = [merge_levels(parts[(srv.spec.label, ds, lvl.key)]) for lvl in cfg.levels]
            runs.append({"label": srv.spec.label, "dataset": ds, "url": srv.url, "command": srv.cmd,
                         "notes": srv.spec.notes, "levels": levels})
    return runs


def _progress(label: str, ds: str, level: Level, rnd: int, res: dict[str, Any], wall: float) -> str:
    tp = res["output_throughput_tok_s"] or 0.0
    p99 = res["tpot_ms"]["p99"]
    acc = (res.get("spec_decode") or {}).get("acceptance_rate")
    faults = res.get("server_minor_faults")
    churn = faults is not None and faults > 10_000 * wall  # engine/malloc.py: a sick process, not a result
    return (f"  [{ds} {level.key} r{rnd}] {label:>16}: {res['completed']}/{res['num_requests']} ok, "
            f"{tp:6.1f} tok/s, TPOT p99 {p99 if p99 is not None else float('nan'):6.0f} ms"
            + (f", acceptance {acc:.2f}" if acc is not None else "") + f" ({wall:.0f} s)"
            + (f" [{faults / wall:,.0f} page faults/s: malloc churn]" if churn else ""))
