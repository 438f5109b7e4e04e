"""/health latency while clients send the most expensive requests that pass validation:
`python -m tools.bench_health [--seconds 30] [--clients 8] [--out FILE.json]`.

The server (default model; default settings but a 1 GiB KV cache) runs in this process under uvicorn,
as `specserve serve` runs it. The clients run in one child process and a /health prober (one GET every
--interval seconds) in another, so that neither the server's GIL nor the senders' own work delays a
probe. Each client
sends its request kind in a loop, sized from the server's limits:

- tokenize_text: /tokenize, one prompt of --max-prompt-chars characters (tokenizer, GIL released)
- tokenize_chat: /tokenize, min(max_model_len, MAX_CHAT_MESSAGES) messages holding --max-prompt-chars
                 characters (template render)
- detokenize:    /detokenize, max_model_len token ids
- chat:          /v1/chat/completions, one message that fills the context, max_tokens 1 (engine prefill)
- batch_echo:    /v1/completions, 256 prompts of up to max_model_len - 1 token ids (as many as the body
                 limit lets through), echo, streamed; the client
                 leaves after the first event (the batch would otherwise prefill for minutes). Its JSON
                 body is decoded on the event loop before any limit can look at it.

The machine may be shared and noisy: the figure is a p99 over one run.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime as dt
import json
import multiprocessing
import platform
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
KINDS = ("tokenize_text", "tokenize_chat", "detokenize", "chat", "batch_echo")
TARGET_P99_MS = 100.0
WORDS = ("the", "model", "server", "token", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "river",
         "mountain", "cloud", "window", "garden", "number", "seven", "ninety", "alpha", "omega", "signal")


# -- server side (this process) ---------------------------------------------------------------------

@contextmanager
def running_server(overrides: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The specserve app under uvicorn in a thread; yields (base URL, OpenAIServing)."""
    import uvicorn

    from server.app import build_app
    from server.engine_client import create_engine_client
    from server.settings import ServerSettings

    settings = ServerSettings(**overrides)
    client = create_engine_client(settings, show_progress=False)
    app = build_app(settings, client)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    # In-flight preprocessing (a long tokenize) is not cancellable: give it time to end at shutdown.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.serving
    finally:
        client.abort_all()
        server.should_exit = True
        thread.join(30)
        sock.close()
        client.shutdown()


def client_plan(serving: Any) -> dict[str, Any]:
    """What the clients need to size their requests: the server's limits and one context-filling text."""
    from server.protocol import MAX_CHAT_MESSAGES, MAX_CHOICES
    from server.tokens import longest_token

    tokenizer = serving.client.tokenizer
    max_len = serving.client.max_model_len
    # The longest vocabulary entry, repeated: the most characters a prompt that fits the context can have.
    piece = tokenizer.convert_tokens_to_string([max(tokenizer.get_vocab(), key=len)])
    count = max_len - 32  # room for the chat template and the answer
    while len(tokenizer.apply_chat_template([{"role": "user", "content": "0000000 " + piece * count}],
                                            add_generation_prompt=True, return_dict=False)) >= max_len - 1:
        count -= 16
    # Messages sized so that the rendered chat (the template adds text per message) stays under the limit.
    empty = {"role": "assistant", "content": ""}  # the longer role name
    overhead = len(tokenizer.apply_chat_template([empty, empty], tokenize=False)) - len(
        tokenizer.apply_chat_template([empty], tokenize=False))
    num_messages = min(max_len, MAX_CHAT_MESSAGES)
    per_message = max(1, (serving.max_prompt_chars - 64) // num_messages - overhead)
    return {"max_prompt_chars": serving.max_prompt_chars, "max_model_len": max_len,
            "max_body": serving.settings.max_request_body_size,
            "longest_token_chars": longest_token(tokenizer),
            "vocab_size": serving.client.core.loaded.vocab_size, "max_choices": MAX_CHOICES,
            "num_messages": num_messages, "chars_per_message": per_message, "fill_piece": piece,
            "fill_count": count}


# -- client side (child process) --------------------------------------------------------------------

def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def _body(kind: str, plan: dict[str, Any], rng: random.Random) -> tuple[str, bytes]:
    max_len, vocab = plan["max_model_len"], plan["vocab_size"]
    if kind == "tokenize_text":
        return "/tokenize", json.dumps({"prompt": _text(rng, plan["max_prompt_chars"])}).encode()
    if kind == "tokenize_chat":
        messages = [{"role": "user" if i % 2 == 0 else "assistant",
                     "content": _text(rng, plan["chars_per_message"])} for i in range(plan["num_messages"])]
        return "/tokenize", json.dumps({"messages": messages}).encode()
    if kind == "detokenize":
        return "/detokenize", json.dumps({"tokens": [rng.randrange(vocab) for _ in range(max_len)]}).encode()
    if kind == "chat":
        # A fresh first line each time, so the prefix cache cannot skip the prefill.
        content = f"{rng.randrange(10**7):07d} " + plan["fill_piece"] * plan["fill_count"]
        return "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": content}],
                                                   "max_tokens": 1}).encode()
    if kind == "batch_echo":
        # As long as the body limit lets them be: a token id takes at most 7 bytes of JSON ("49151, ").
        per_prompt = min(max_len - 1, (plan["max_body"] - 1024) // (7 * plan["max_choices"]))
        prompts = [[rng.randrange(vocab) for _ in range(per_prompt)] for _ in range(plan["max_choices"])]
        return "/v1/completions", json.dumps({"prompt": prompts, "echo": True, "max_tokens": 1,
                                              "stream": True}).encode()
    raise ValueError(kind)


async def _client(url: str, kind: str, plan: dict[str, Any], seed: int, stop: float,
                  out: list[dict[str, Any]]) -> None:
    import httpx

    rng = random.Random(seed)
    path, body = _body(kind, plan, rng)
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        while time.monotonic() < stop:
            if kind == "chat":
                path, body = _body(kind, plan, rng)
            t0 = time.monotonic()
            try:
                if kind == "batch_echo":
                    async with http.stream("POST", path, content=body, headers=headers) as resp:
                        async for _ in resp.aiter_lines():
                            break  # the first event came: leave (the server aborts the batch)
                else:
                    resp = await http.post(path, content=body, headers=headers)
                status = resp.status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            out.append({"kind": kind, "status": status, "seconds": time.monotonic() - t0})


def run_prober(url: str, interval: float, start: float, stop: float) -> dict[str, list[float]]:
    """A child process of its own, so that the senders' work (building and streaming bodies of many
    MiB) never delays a probe: /health alone until `start` (the machine's own noise), then beside the
    senders until `stop` (wall-clock times, shared with the senders' process)."""
    import httpx

    out: dict[str, list[float]] = {"idle_health_s": [], "health_s": []}
    with httpx.Client(base_url=url, timeout=60) as http:
        while (now := time.time()) < stop:
            t0 = time.monotonic()
            resp = http.get("/health")
            if resp.status_code == 200:
                out["idle_health_s" if now < start else "health_s"].append(time.monotonic() - t0)
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    return out


def run_clients(url: str, plan: dict[str, Any], kinds: list[str], clients: int, start: float,
                stop: float) -> list[dict[str, Any]]:
    """A child process: `clients` senders (kinds round-robin) from `start` to `stop` (wall clock)."""
    async def main() -> list[dict[str, Any]]:
        await asyncio.sleep(max(0.0, start - time.time()))
        requests: list[dict[str, Any]] = []
        mono_stop = time.monotonic() + (stop - time.time())
        tasks = [asyncio.create_task(_client(url, kinds[i % len(kinds)], plan, i, mono_stop, requests))
                 for i in range(clients)]
        await asyncio.sleep(max(0.0, stop - time.time()))
        # Requests still running at the end are cancelled (their connections close; the server aborts them).
        await asyncio.wait(tasks, timeout=5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return requests

    return asyncio.run(main())


# -- report -----------------------------------------------------------------------------------------

def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(raw: dict[str, Any], kinds: list[str]) -> dict[str, Any]:
    per_kind = {}
    for kind in kinds:
        rows = [r for r in raw["requests"] if r["kind"] == kind]
        per_kind[kind] = {
            "finished": len(rows),
            "ok": sum(1 for r in rows if r["status"] == 200),
            "status_4xx": sum(1 for r in rows if isinstance(r["status"], int) and 400 <= r["status"] < 500),
            "other": sum(1 for r in rows if not (isinstance(r["status"], int) and r["status"] < 500)),
            "mean_s": statistics.fmean(r["seconds"] for r in rows) if rows else None,
        }
    return {"kinds": per_kind, "health": _latency(raw["health_s"]),
            "idle_health": _latency(raw["idle_health_s"])}


def _latency(seconds: list[float]) -> dict[str, Any]:
    ms = [s * 1000 for s in seconds]
    if not ms:
        return {"n": 0}
    return {"n": len(ms), "p50_ms": _percentile(ms, 0.5), "p99_ms": _percentile(ms, 0.99), "max_ms": max(ms)}


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'kind':<15}{'finished':>9}{'ok':>6}{'4xx':>6}{'other':>7}{'mean s':>9}")
    for kind, k in summary["kinds"].items():
        mean = f"{k['mean_s']:.2f}" if k["mean_s"] is not None else "-"
        print(f"{kind:<15}{k['finished']:>9}{k['ok']:>6}{k['status_4xx']:>6}{k['other']:>7}{mean:>9}")
    for label, key in (("/health, idle server", "idle_health"), ("/health under load", "health")):
        h = summary[key]
        if h["n"]:
            print(f"{label}: {h['n']} probes, p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms, "
                  f"max {h['max_ms']:.1f} ms")
        else:
            print(f"{label}: no answer")
    print(f"target: p99 < {TARGET_P99_MS:g} ms under load")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="how long the clients send")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between /health probes")
    ap.add_argument("--idle-seconds", type=float, default=5.0,
                    help="probe the idle server first, for the machine's own latency")
    ap.add_argument("--max-model-len", type=int, default=None, help="server setting (default: the server's)")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="server setting")
    ap.add_argument("--max-request-body-size", default=None, help="server setting (default: the server's)")
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = set(args.kinds) - set(KINDS)
    if unknown or not args.kinds:
        ap.error(f"--kinds: unknown {sorted(unknown)}; choose from {', '.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides: dict[str, Any] = {"kv_cache_memory": args.kv_cache_memory, "log_stats_interval": 0,
                                 "disable_log_requests": True, "uvicorn_log_level": "warning"}
    if args.max_model_len is not None:
        overrides["max_model_len"] = args.max_model_len
    if args.max_request_body_size is not None:
        overrides["max_request_body_size"] = args.max_request_body_size
    print("starting the server (default model) ...", file=sys.stderr, flush=True)
    with running_server(overrides) as (url, serving):
        plan = client_plan(serving)
        settings = serving.settings.model_dump(mode="json", exclude={"api_key", "fault_injection"})
        print(f"{args.clients} clients ({', '.join(args.kinds)}) for {args.seconds:g} s against {url}",
              file=sys.stderr, flush=True)
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=spawn) as pool:
            start = time.time() + 5 + args.idle_seconds  # after both processes have started
            stop = start + args.seconds
            probes = pool.submit(run_prober, url, args.interval, start, stop)
            senders = pool.submit(run_clients, url, plan, args.kinds, args.clients, start, stop)
            raw = {**probes.result(), "requests": senders.result()}
    summary = summarize(raw, args.kinds)
    print_table(summary)
    if args.out is not None:
        report = {
            "schema_version": SCHEMA_VERSION,
            "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpu_count": multiprocessing.cpu_count()},
            "command": ["python", "-m", "tools.bench_health", *(sys.argv[1:] if argv is None else argv)],
            "config": {"seconds": args.seconds, "clients": args.clients, "kinds": args.kinds,
                       "interval_s": args.interval, "idle_seconds": args.idle_seconds,
                       "target_p99_ms": TARGET_P99_MS},
            "server_settings": settings,
            "limits": {k: v for k, v in plan.items() if k not in ("fill_piece", "fill_count")},
            **summary,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
