"""Scale-out against one engine, on the same machine: aggregate throughput at a fixed concurrency, and the
prefix-cache hit rate of a multi-turn workload. `--compare replicas`: replicas on Ray Serve (prefix-aware
routing vs Serve's default router); `--compare tensor-parallel`: the model split over 2 ranks. Each
server is started alone in turn, rounds rotate the order; the table gives medians over rounds and ratios
to one engine."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.datasets import chat_items
from loadtests.servers import ServerProcess, ServerSpec, specserve_command

# label -> (flags, environment); replicas inherit the environment of the cluster the CLI starts.
COMPARISONS: dict[str, dict[str, tuple[list[str], dict[str, str]]]] = {
    "replicas": {
        "one engine": ([], {}),
        "1 replica on Ray Serve": (["--replicas", "1", "--max-replicas", "1"], {}),
        "2 replicas, prefix routing": (["--replicas", "2"], {}),
        "2 replicas, Serve's router": (["--replicas", "2", "--replica-routing", "power-of-two"], {}),
    },
    "tensor-parallel": {
        "one engine": ([], {}),
        # what each rank runs: MLX's modules, without the one-call C layer stack
        "one engine, MLX modules": ([], {"SPECSERVE_CPU_LAYERS": "off"}),
        "2 ranks (tensor parallel)": (["--tensor-parallel-size", "2"], {}),
    },
}


async def _throughput(url: str, concurrency: int, requests: int, max_tokens: int) -> float:
    """Generated tokens per second with `concurrency` clients each sending requests back to back."""
    prompts = [it.messages for it in chat_items()]
    todo = list(range(requests))
    tokens = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while todo:
            i = todo.pop()
            r = await http.post("/v1/chat/completions", json={
                "messages": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True})
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        return tokens / (time.perf_counter() - t0)


async def _multi_turn(url: str, conversations: int, turns: int, concurrency: int, max_tokens: int,
                      salt: str) -> dict[str, int]:
    """Conversations of `turns` turns, `concurrency` at a time; prompt and cached tokens over all turns."""
    totals = {"prompt_tokens": 0, "cached_tokens": 0}
    todo = list(range(conversations))

    async def conversation(http: httpx.AsyncClient, i: int) -> None:
        msgs = [{"role": "system", "content": f"Session {salt}-{i}. You are a concise assistant who "
                                              f"remembers every earlier message of session {i}."}]
        for t in range(turns):
            msgs.append({"role": "user", "content": f"Turn {t}: tell me one more fact about topic {i}."})
            r = await http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": max_tokens,
                                                              "temperature": 0})
            r.raise_for_status()
            body = r.json()
            totals["prompt_tokens"] += body["usage"]["prompt_tokens"]
            totals["cached_tokens"] += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    async def worker(http: httpx.AsyncClient) -> None:
        while todo:
            await conversation(http, todo.pop())

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return totals


def run(args: argparse.Namespace) -> int:
    out = Path(args.output_dir)
    configs = COMPARISONS[args.compare]
    rows: dict[str, list[dict[str, Any]]] = {label: [] for label in configs}
    labels = list(configs)
    for rnd in range(args.rounds):
        for label in labels[rnd % len(labels):] + labels[:rnd % len(labels)]:
            cmd = specserve_command(max_model_len=2048, kv_cache_memory=args.kv_cache_memory,
                                    extra=configs[label][0])
            spec = ServerSpec(label=label, command=cmd, env=configs[label][1], startup_timeout_s=600)
            srv = ServerProcess(spec, out / "logs" / f"{label.replace(' ', '_').replace(',', '')}.log")
            if not srv.start():
                print(f"{label}: did not start: {srv.error}", file=sys.stderr)
                return 1
            try:
                asyncio.run(_throughput(srv.url, args.concurrency, args.concurrency, 8))  # warm-up
                tps = asyncio.run(_throughput(srv.url, args.concurrency, args.requests, args.max_tokens))
                mt = asyncio.run(_multi_turn(srv.url, args.conversations, args.turns, args.mt_concurrency,
                                             32, salt=f"r{rnd}"))
            finally:
                srv.stop()
            hit = mt["cached_tokens"] / max(mt["prompt_tokens"], 1)
            rows[label].append({"round": rnd, "tokens_per_s": tps, "hit_rate": hit, **mt})
            print(f"round {rnd} {label}: {tps:.1f} tok/s at {args.concurrency}, prefix-cache hit rate "
                  f"{hit:.3f}", flush=True)
    base = labels[0]

    def med(label: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[label])

    def ratio(label: str, key: str) -> float:  # per round, then the median
        pairs = zip(rows[label], rows[base], strict=True)
        return statistics.median(a[key] / b[key] if b[key] else 0.0 for a, b in pairs)

    lines = [f"| server | tok/s at {args.concurrency} | vs one engine | multi-turn hit rate | vs one |",
             "|---|---|---|---|---|"]
    summary = {}
    for label in labels:
        summary[label] = {"tokens_per_s": med(label, "tokens_per_s"),
                          "tokens_ratio": ratio(label, "tokens_per_s"),
                          "hit_rate": med(label, "hit_rate"), "hit_ratio": ratio(label, "hit_rate")}
        s = summary[label]
        lines.append(f"| {label} | {s['tokens_per_s']:.1f} | {s['tokens_ratio']:.3f}x | "
                     f"{s['hit_rate']:.3f} | {s['hit_ratio']:.3f}x |")
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.compare}.json").write_text(json.dumps({
        "schema": "specserve-bench-replicas/1", "args": {k: v for k, v in vars(args).items()
                                                           if isinstance(v, (int, float, str))},
        "rounds": rows, "summary": summary}, indent=2) + "\n")
    (out / f"{args.compare}.md").write_text(table + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compare", choices=list(COMPARISONS), default="replicas",
                   help="one engine against replicas on Ray Serve, or against the model over 2 ranks")
    p.add_argument("--rounds", type=int, default=3, help="each server this many times, order rotated")
    p.add_argument("--concurrency", type=int, default=16, help="clients of the throughput part")
    p.add_argument("--requests", type=int, default=48, help="requests of the throughput part")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request of the throughput part")
    p.add_argument("--conversations", type=int, default=24, help="conversations of the multi-turn part")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--mt-concurrency", type=int, default=8, help="conversations at once")
    p.add_argument("--kv-cache-memory", default="512MiB", help="each engine's (each replica's) KV cache")
    p.add_argument("--output-dir", default="results/tmp/bench-replicas")
