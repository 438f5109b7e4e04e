"""`specserve bench serve`: online load against any OpenAI-compatible server, as `vllm bench serve`.

Requests arrive at `--request-rate` per second (Poisson; inf: all at once), at most `--max-concurrency`
in flight, `--num-prompts` in all (cycling through the dataset). Streams every response and times it
chunk by chunk (TTFT, TPOT, ITL, e2e: mean and p50 / p90 / p99), reads the server's
`vllm:spec_decode_*` counters from `/metrics` before and after (acceptance of exactly these requests),
prints the result the way vLLM does, and with `--save-result` writes it as JSON (`--plot`: latency
distributions as PNG).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loadtests import report
from loadtests.client import normalize_base_url, resolve_model
from loadtests.datasets import load_dataset
from loadtests.runner import Level, run_level, warm_up


def run(args: argparse.Namespace) -> int:
    url = normalize_base_url(args.base_url)
    items = load_dataset(args.dataset_name, args.data)
    opts = args.request if args.request.model else replace(
        args.request, model=resolve_model(url, args.request.api_key))
    level = Level(request_rate=args.request_rate, max_concurrency=args.max_concurrency)
    label = args.label or opts.model or "server"
    if args.num_warmups:
        asyncio.run(warm_up(url, items, replace(opts, max_tokens=8), args.num_warmups))
    with tqdm(total=args.num_prompts, desc="requests", disable=args.disable_tqdm) as bar:
        result = asyncio.run(run_level(url, items, opts, level, args.num_prompts, args.duration,
                                       seed=args.data.seed, bar=bar))
    print(report.serving_result(result))
    stem = args.result_filename or _default_name(label, args.dataset_name, level)
    out = Path(args.result_dir) / (stem if stem.endswith(".json") else f"{stem}.json")
    if args.save_result:
        config = {"base_url": url, "model": opts.model, "dataset_name": args.dataset_name,
                  "dataset_path": args.data.dataset_path, "num_prompts": args.num_prompts,
                  "duration_s": args.duration, "warmup": args.num_warmups,
                  "request": {k: v for k, v in asdict(opts).items() if k != "api_key"},
                  "data": asdict(args.data)}
        run_doc: dict[str, Any] = {"label": label, "dataset": args.dataset_name, "url": url,
                                   "levels": [result]}
        report.write_json(report.result_document("serve", config, [run_doc]), out,
                          keep_requests=args.save_detailed)
        print(f"wrote {out}")
    if args.plot:
        from loadtests.plots import plot_latencies

        title = f"{label}, {args.dataset_name}, {level.key}"
        png = plot_latencies(result, out.with_suffix(".png"), title=title)
        print(f"wrote {png}")
    return 0 if result["completed"] else 1  # nothing served at all: a wrong URL or a dead server


def _default_name(label: str, dataset: str, level: Level) -> str:
    when = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return report.slug(f"{label}-{dataset}-{level.key}-{when}")
