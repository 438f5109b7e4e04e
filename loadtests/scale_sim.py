"""Capacity planning for replicas: a discrete-event simulation of multi-turn chat users over R engine
replicas, each engine's steps priced by a cost model fitted to a real engine's step trace.

    specserve bench scale-sim --trace STEPS.jsonl [--users 10,100,1000] [--replicas 1,2,4,8,16,32]
    specserve bench scale-sim --step-cost A,B,C ...   (the fit a run printed, without the trace)

The trace comes from `specserve serve --step-trace STEPS.jsonl` under load (`specserve bench serve`). A
step costs a + b x requests + c x tokens (least squares over the trace). Each user holds a conversation
(a system prompt, then turns of a question and a reply, a think time between turns) and starts another
after the last turn. An engine runs up to max_num_seqs requests, fills each step with decode rows first
and prefill chunks up to max_num_batched_tokens, and keeps finished conversations' KV (their whole
context) in a prefix cache of the pool's free space, least recently used first out. Routing `prefix`
sends a conversation's turns to the replica that served its last turn (new ones to the least loaded),
`power-of-two` the least loaded of two random replicas (Serve's default).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.traces import load


@dataclass(frozen=True)
class StepCost:
    a: float  # seconds per step
    per_request: float
    per_token: float

    def __call__(self, requests: int, tokens: int) -> float:
        return self.a + self.per_request * requests + self.per_token * tokens

    @classmethod
    def fit(cls, records: list[dict[str, Any]]) -> StepCost:
        x = np.array([[1.0, r["requests"], r["tokens"]] for r in records])
        y = np.array([r["step_s"] for r in records])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        return cls(*(max(float(c), 0.0) for c in coef))


@dataclass(frozen=True)
class Workload:
    system_tokens: int = 200
    user_tokens: int = 60
    reply_tokens: int = 150
    turns: int = 5
    think_s: float = 20.0


@dataclass(frozen=True)
class Engine:
    kv_tokens: int = 65536
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


@dataclass
class _Req:
    user: int
    conv: int
    prompt: int  # context tokens of this turn
    todo_prefill: int
    reply: int
    sent: float
    generated: int = 0
    first_token: float | None = None


@dataclass
class _Replica:
    running: list[_Req] = field(default_factory=list)
    waiting: deque[_Req] = field(default_factory=deque)
    cache: OrderedDict[int, int] = field(default_factory=OrderedDict)  # conv -> cached context tokens
    # The step under way (its decode rows and prefill chunks), None while idle.
    step: tuple[list[_Req], list[tuple[_Req, int]]] | None = None

    def load(self) -> int:
        return len(self.running) + len(self.waiting)


def simulate(users: int, replicas: int, routing: str, cost: StepCost, wl: Workload, eng: Engine,
             duration_s: float = 600.0, warmup_s: float = 60.0, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    reps = [_Replica() for _ in range(replicas)]
    events: list[tuple[float, int, str, int]] = []  # (time, tie, kind, who)
    tie = 0

    def push(t: float, kind: str, who: int) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(events, (t, tie, kind, who))

    conv_of = list(range(users))
    turn_of = [0] * users
    context = [0] * users
    home: dict[int, int] = {}
    next_conv = users
    ttft, tpot, prompt_total, cached_total, generated = [], [], 0, 0, 0
    for u in range(users):
        push(rng.uniform(0, wl.think_s), "send", u)

    def pick(conv: int) -> int:
        if routing == "prefix" and conv in home:
            return home[conv]
        if routing == "prefix" or replicas == 1:
            return min(range(replicas), key=lambda r: (reps[r].load(), rng.random()))
        a, b = rng.sample(range(replicas), 2)
        return a if reps[a].load() <= reps[b].load() else b

    def start_step(r: int, now: float) -> None:
        rep = reps[r]
        used = sum(q.prompt + q.generated for q in rep.running)
        while rep.waiting and len(rep.running) < eng.max_num_seqs:
            q = rep.waiting[0]
            if used + q.prompt + q.reply > eng.kv_tokens and rep.running:
                break
            rep.waiting.popleft()
            rep.running.append(q)
            used += q.prompt + q.reply
        # The prefix cache lives in what running requests leave free: the oldest conversations go first.
        while rep.cache and used + sum(rep.cache.values()) > eng.kv_tokens:
            rep.cache.popitem(last=False)
        if not rep.running:
            rep.step = None
            return
        budget = eng.max_num_batched_tokens
        decode = [q for q in rep.running if q.todo_prefill == 0]
        tokens = len(decode)
        budget -= tokens
        chunks: list[tuple[_Req, int]] = []
        for q in rep.running:
            if q.todo_prefill and budget > 0:
                n = min(q.todo_prefill, budget)
                chunks.append((q, n))
                budget -= n
                tokens += n
        rep.step = (decode, chunks)
        push(now + cost(len(decode) + len(chunks), tokens), "step", r)

    while events:
        now, _, kind, who = heapq.heappop(events)
        if now > duration_s:
            break
        if kind == "send":
            u = who
            conv = conv_of[u]
            prompt = (wl.system_tokens if turn_of[u] == 0 else context[u]) + wl.user_tokens
            r = pick(conv)
            home[conv] = r
            cached = min(reps[r].cache.pop(conv, 0), prompt - 1)
            q = _Req(u, conv, prompt, prompt - cached, wl.reply_tokens, now)
            if now >= warmup_s:
                prompt_total += prompt
                cached_total += cached
            reps[r].waiting.append(q)
            if reps[r].step is None:
                start_step(r, now)
        else:
            r = who
            rep = reps[r]
            assert rep.step is not None
            decode, chunks = rep.step
            for q, n in chunks:
                q.todo_prefill -= n
                if q.todo_prefill == 0:
                    q.generated, q.first_token = 1, now
            for q in decode:
                q.generated += 1
            for q in [q for q in rep.running if q.generated >= q.reply]:
                rep.running.remove(q)
                if q.sent >= warmup_s:
                    ttft.append(q.first_token - q.sent)
                    tpot.append((now - q.first_token) / max(q.reply - 1, 1))
                    generated += q.reply
                rep.cache[q.conv] = q.prompt + q.reply
                u = q.user
                context[u] = q.prompt + q.reply
                turn_of[u] += 1
                if turn_of[u] == wl.turns:  # a new conversation
                    rep.cache.move_to_end(q.conv)
                    home.pop(q.conv, None)
                    conv_of[u], turn_of[u], context[u] = next_conv, 0, 0
                    next_conv += 1
                push(now + rng.expovariate(1.0 / wl.think_s) if wl.think_s > 0 else now, "send", u)
            start_step(r, now)

    def pct(xs: list[float], p: float) -> float | None:
        return float(np.percentile(xs, p)) if xs else None

    span = duration_s - warmup_s
    return {"users": users, "replicas": replicas, "routing": routing,
            "tokens_per_s": generated / span, "requests": len(ttft),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_p50_s": pct(tpot, 50),
            "tpot_p99_s": pct(tpot, 99), "hit_rate": cached_total / prompt_total if prompt_total else 0.0}


def run(args: argparse.Namespace) -> int:
    if args.step_cost:
        records: list[dict[str, Any]] = []
        cost = StepCost(*(float(x) / 1e3 for x in args.step_cost.split(",")))
    else:
        records = [r for path in args.trace or [] for r in load(path)]
        if len(records) < 3:
            raise SystemExit("scale-sim needs --trace with steps in it, or --step-cost")
        cost = StepCost.fit(records)
    wl = Workload(args.system_tokens, args.user_tokens, args.reply_tokens, args.turns, args.think_s)
    eng = Engine(args.kv_tokens, args.max_num_seqs, args.max_num_batched_tokens)
    print(f"step cost ({f'fitted to {len(records)} steps' if records else 'given'}): {cost.a * 1e3:.3f} ms + "
          f"{cost.per_request * 1e3:.4f} ms x requests + {cost.per_token * 1e3:.4f} ms x tokens "
          f"(--step-cost {cost.a * 1e3:.4f},{cost.per_request * 1e3:.4f},{cost.per_token * 1e3:.4f})")
    rows = []
    header = ("| users | replicas | routing | tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | "
              "prefix hit rate |\n|---|---|---|---|---|---|---|")
    print(header)
    for users in [int(u) for u in args.users.split(",")]:
        for replicas in [int(r) for r in args.replicas.split(",")]:
            for routing in (["prefix", "power-of-two"] if replicas > 1 else ["prefix"]):
                row = simulate(users, replicas, routing, cost, wl, eng, args.duration, args.warmup, args.seed)
                rows.append(row)

                def f(x: float | None, scale: float = 1.0, fmt: str = ".2f") -> str:
                    return "-" if x is None else format(x * scale, fmt)

                print(f"| {users} | {replicas} | {routing} | {row['tokens_per_s']:.0f} | "
                      f"{f(row['ttft_p50_s'])} / {f(row['ttft_p99_s'])} | "
                      f"{f(row['tpot_p50_s'], 1e3, '.0f')} / {f(row['tpot_p99_s'], 1e3, '.0f')} | "
                      f"{row['hit_rate']:.3f} |", flush=True)
    need = {}
    for users in sorted({r["users"] for r in rows}):
        ok = [r for r in rows if r["users"] == users and r["routing"] == "prefix"
              and r["ttft_p99_s"] is not None and r["ttft_p99_s"] <= args.ttft_slo
              and r["tpot_p50_s"] <= args.tpot_slo]
        need[users] = min((r["replicas"] for r in ok), default=None)
    needed = ", ".join(f"{u} users: {n if n is not None else 'more than simulated'}" for u, n in need.items())
    print(f"replicas needed (prefix routing; TTFT p99 <= {args.ttft_slo} s, "
          f"TPOT p50 <= {args.tpot_slo * 1e3:.0f} ms): {needed}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({
            "schema": "specserve-scale-sim/1", "step_cost": asdict(cost), "workload": asdict(wl),
            "engine": asdict(eng), "trace": args.trace, "rows": rows,
            "replicas_needed": {str(k): v for k, v in need.items()}}, indent=2) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", action="append", metavar="STEPS.jsonl",
                   help="a `specserve serve --step-trace` file (repeatable)")
    p.add_argument("--step-cost", metavar="A,B,C", default=None,
                   help="milliseconds per step, per request, per token: instead of fitting a trace")
    p.add_argument("--users", default="10,100,1000", help="concurrent users (comma-separated)")
    p.add_argument("--replicas", default="1,2,4,8,16,32", help="replica counts (comma-separated)")
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--user-tokens", type=int, default=60, help="tokens each question adds")
    p.add_argument("--reply-tokens", type=int, default=150)
    p.add_argument("--turns", type=int, default=5, help="turns per conversation")
    p.add_argument("--think-s", type=float, default=20.0, help="mean seconds from a reply to the next turn")
    p.add_argument("--kv-tokens", type=int, default=65536, help="each replica's KV pool in tokens")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds")
    p.add_argument("--warmup", type=float, default=60.0, help="simulated seconds left out of the statistics")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT p99 a user needs (seconds)")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT p50 a user needs (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the rows as JSON here")
