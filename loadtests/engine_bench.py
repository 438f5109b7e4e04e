"""Engine throughput against mlx-lm, interleaved in one run: `specserve bench engine`.

One worker process per BLAS setting (`SPECSERVE_BLAS` must be set before mlx is imported). Each loads the
default model once in float32 and, per repeat and concurrency, runs specserve's engine and mlx-lm back to
back on the same model object, alternating which goes first. Compare the two within one run (the ratios),
not absolute tok/s across runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
ENGINES = ("specserve", "mlx_lm")
PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the ocean.",
    "How do I reverse a list in Python?",
    "Give me three tips for better sleep.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a friendly robot.",
    "How does a rainbow form?",
    "List four primary uses of copper.",
    "Why is the sky blue?",
    "What is a prime number? Give an example.",
    "Describe a good breakfast for a runner.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish and French.",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- worker (runs in its own process; mlx is imported only in here) --------------------------------

class Worker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        import mlx.core as mx

        from engine.llm import LLM
        from engine.models.loader import load_model

        self.mx = mx
        self.cfg = cfg
        t0 = time.perf_counter()
        self.loaded = load_model(None, dtype="float32", progress=False)
        self.llm = LLM(loaded=self.loaded, kv_cache_memory=cfg["kv_cache_memory"],
                       max_model_len=cfg["max_model_len"], show_progress=False)
        self.load_s = time.perf_counter() - t0
        self.prompts = [self.llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        self._rid = 0

    def batch(self, c: int) -> list[list[int]]:
        return [self.prompts[i % len(self.prompts)] for i in range(c)]

    def run_specserve(self, prompts: list[list[int]], n: int) -> dict[str, Any]:
        from engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        core = self.llm.core
        toks: dict[str, list[int]] = {}
        first: dict[str, float] = {}
        t0 = time.perf_counter()
        # Drive the core directly (as LLM.generate does) so first-token times are visible.
        for p in prompts:
            rid = f"bench-{self._rid}"
            self._rid += 1
            core.add_request(rid, p, params)
            toks[rid] = []
        while core.has_unfinished():
            outputs, _ = core.step()
            now = time.perf_counter()
            for out in outputs:
                if out.new_token_ids and not toks[out.request_id]:
                    first[out.request_id] = now - t0
                toks[out.request_id].extend(out.new_token_ids)
        wall = time.perf_counter() - t0
        self.mx.synchronize()
        return self._result(wall, list(toks.values()), list(first.values()), prompts)

    def run_mlx_lm(self, prompts: list[list[int]], n: int) -> dict[str, Any]:
        mx = self.mx
        from mlx_lm.generate import BatchGenerator, generate_step

        def argmax(logprobs: Any) -> Any:
            return mx.argmax(logprobs, axis=-1)

        if len(prompts) == 1:
            out: list[int] = []
            ttft = 0.0
            t0 = time.perf_counter()
            steps = generate_step(mx.array(prompts[0]), self.loaded.model, max_tokens=n, sampler=argmax)
            for tok, _ in steps:
                if not out:
                    ttft = time.perf_counter() - t0
                out.append(int(tok))
            wall = time.perf_counter() - t0
            # generate_step schedules one step past max_tokens; keep it out of the next measurement.
            mx.synchronize()
            return self._result(wall, [out], [ttft], prompts)
        # No stop tokens == ignore_eos. One prefill batch for all prompts: mlx-lm's best case here.
        gen = BatchGenerator(self.loaded.model, max_tokens=n, sampler=argmax, stop_tokens=None,
                             prefill_batch_size=len(prompts),
                             completion_batch_size=max(32, len(prompts)))
        t0 = time.perf_counter()
        uids = gen.insert(prompts, [n] * len(prompts))
        res: dict[int, list[int]] = {u: [] for u in uids}
        first: dict[int, float] = {}
        while responses := gen.next_generated():
            now = time.perf_counter()
            for r in responses:
                if not res[r.uid]:
                    first[r.uid] = now - t0
                res[r.uid].append(int(r.token))
        wall = time.perf_counter() - t0
        gen.close()
        mx.synchronize()
        return self._result(wall, [res[u] for u in uids], list(first.values()), prompts)

    @staticmethod
    def _result(wall: float, toks: list[list[int]], ttfts: list[float], prompts: list[list[int]]
                ) -> dict[str, Any]:
        gen = sum(len(t) for t in toks)
        # Rough steady-state decode rate: tokens after each first token, over the time after the last.
        tail = wall - max(ttfts, default=0.0)
        return {"wall_s": wall, "generated_tokens": gen, "prompt_tokens": sum(len(p) for p in prompts),
                "tok_s": gen / wall if wall > 0 else 0.0,
                "decode_tok_s": (gen - len(toks)) / tail if tail > 0 else None,
                "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
                "ttft_max_s": max(ttfts) if ttfts else None, "token_ids": toks}

    def run(self, name: str, c: int, n: int) -> dict[str, Any]:
        fn = self.run_specserve if name == "specserve" else self.run_mlx_lm
        return fn(self.batch(c), n)


def worker_main(cfg: dict[str, Any], out_path: str) -> None:
    import engine
    from engine import platform

    platform.setup()  # the BLAS, malloc and OpenMP choices, before the worker imports mlx

    w = Worker(cfg)
    import mlx.core as mx

    from engine.blas import blas_info

    blas = blas_info()
    setting = os.environ.get("SPECSERVE_BLAS", "auto")
    log(f"[{setting}] blas={blas.name} model={w.loaded.name} loaded in {w.load_s:.1f}s")
    n, concs = cfg["max_tokens"], cfg["concurrency"]
    t0 = time.perf_counter()
    for name in ENGINES:  # warm-up: first-call costs (allocations, kernels) stay out of the numbers
        for c in sorted({1, min(2, max(concs))}):
            w.run(name, c, min(n, 4))
    warmup_s = time.perf_counter() - t0
    runs: list[dict[str, Any]] = []
    for rep in range(cfg["repeats"]):
        for i, c in enumerate(concs):
            # Alternate the order per repeat (and per concurrency) so drift hurts both sides alike.
            order = ENGINES if (rep + i) % 2 == 0 else ENGINES[::-1]
            pair: dict[str, dict[str, Any]] = {}
            for pos, name in enumerate(order):
                r = w.run(name, c, n)
                r.update(engine=name, concurrency=c, repeat=rep, ran=pos)
                pair[name] = r
                log(f"[{setting}] rep {rep} c={c:<2} {name:<9} {r['tok_s']:8.1f} tok/s "
                    f"({r['generated_tokens']} tok, {r['wall_s']:.2f}s, ttft {r['ttft_mean_s']:.3f}s, "
                    f"decode {r['decode_tok_s'] or 0:.1f} tok/s)")
            # Greedy float32 on the same weights: outputs should agree (batching may flip near-ties).
            same = sum(a == b for a, b in zip(pair["specserve"]["token_ids"], pair["mlx_lm"]["token_ids"],
                                             strict=True))
            for r in pair.values():
                r["outputs_match"] = same / c
                r.pop("token_ids")
                runs.append(r)
    info = {"setting": setting, "blas": {"name": blas.name, "path": blas.path, "reason": blas.reason},
            "versions": {"mlx": mx.__version__, "mlx_lm": metadata.version("mlx-lm"),
                         "specserve": engine.__version__},
            "model": {"name": w.loaded.name, "path": w.loaded.path, "source": w.loaded.source,
                      "dtype": str(w.loaded.dtype).removeprefix("mlx.core.")},
            "load_s": w.load_s, "warmup_s": warmup_s, "runs": runs}
    Path(out_path).write_text(json.dumps(info))


# -- parent --------------------------------------------------------------------------------------

def median_table(runs: list[dict[str, Any]], key: str = "tok_s") -> dict[int, dict[str, float]]:
    """-> {concurrency: {engine: median of `key` across repeats}}."""
    acc: dict[int, dict[str, list[float]]] = {}
    for r in runs:
        if r.get(key) is not None:
            acc.setdefault(r["concurrency"], {}).setdefault(r["engine"], []).append(r[key])
    return {c: {e: statistics.median(v) for e, v in d.items()} for c, d in sorted(acc.items())}


def target_checks(med: dict[int, dict[str, float]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    mlx1 = med.get(1, {}).get("mlx_lm")
    ours1 = med.get(1, {}).get("specserve")
    if mlx1 and ours1 is not None:
        ratio = ours1 / mlx1
        out["single_stream"] = {"description": "specserve c=1 >= mlx-lm c=1", "value": ratio,
                                "threshold": 1.0, "pass": ratio >= 1.0}
    else:
        out["single_stream"] = {"description": "needs concurrency 1", "pass": None}
    ours8 = med.get(8, {}).get("specserve")
    if mlx1 and ours8 is not None:
        ratio = ours8 / mlx1
        out["aggregate_8"] = {"description": "specserve c=8 aggregate >= 2x mlx-lm c=1", "value": ratio,
                              "threshold": 2.0, "pass": ratio >= 2.0}
    else:
        out["aggregate_8"] = {"description": "needs concurrency 1 and 8", "pass": None}
    return out


def verdict(check: dict[str, Any]) -> str:
    if check["pass"] is None:
        return "SKIP (" + check["description"] + ")"
    status = "PASS" if check["pass"] else "FAIL"
    return f"{status}  {check['value']:.3f}x (need >= {check['threshold']:.1f}x)"


def ratio_str(a: float | None, b: float | None, width: int) -> str:
    return f"{a / b:>{width}.2f}" if a is not None and b else f"{'n/a':>{width}}"


def print_report(workers: list[dict[str, Any]]) -> None:
    print("\nmedians across repeats; tok/s = generated tokens / batch wall time (prefill included);"
          "\ndecode x = ratio of steady-state decode rates; ttft = mean time to first token (s)")
    print(f"{'blas':<10} {'conc':>4} {'specserve tok/s':>16} {'mlx-lm tok/s':>13} {'ratio':>6} "
          f"{'decode x':>9} {'ttft ours':>10} {'ttft mlx':>9} {'match':>6}")
    for w in workers:
        dec, ttft = w["medians_decode"], w["medians_ttft"]
        for c, d in w["medians"].items():
            ours, ref = d.get("specserve", 0.0), d.get("mlx_lm", 0.0)
            match = statistics.fmean(r["outputs_match"] for r in w["runs"] if r["concurrency"] == c)
            t = ttft.get(c, {})
            print(f"{w['blas']['name']:<10} {c:>4} {ours:>16.1f} {ref:>13.1f} {ratio_str(ours, ref, 6)} "
                  f"{ratio_str(dec.get(c, {}).get('specserve'), dec.get(c, {}).get('mlx_lm'), 9)} "
                  f"{t.get('specserve', float('nan')):>10.3f} {t.get('mlx_lm', float('nan')):>9.3f} "
                  f"{match:>6.0%}")
    print()
    for w in workers:
        p = w["plan"]
        print(f"{w['blas']['name']:<10} plan: concurrency {p['concurrency']}, max_tokens {p['max_tokens']}, "
              f"repeats {p['repeats']}; worker {w['worker_wall_s']:.0f}s")
        for key, chk in w["targets"].items():
            print(f"{w['blas']['name']:<10} {key:<14} {verdict(chk)}")


DEFAULT_PLAN = {"repeats": 2, "concurrency": "1,4,8,16", "max_tokens": 64}
QUICK_PLAN = {"repeats": 1, "concurrency": "1,8", "max_tokens": 16}
# Reference BLAS runs ~7 GFLOP/s: 16-way prefill alone takes about a minute per engine, so by default
# it gets only what the two target checks need (flags given explicitly, or --full-reference, win).
REFERENCE_PLAN = {"repeats": 1, "concurrency": "1,8", "max_tokens": 32}


def parse_concurrency(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise ValueError(text)
    return vals


def _at_least_1(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _concurrency(text: str) -> str:
    try:
        parse_concurrency(text)
    except ValueError:
        raise argparse.ArgumentTypeError("comma-separated integers >= 1, e.g. 1,4,8,16") from None
    return text


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=_at_least_1, help="measured rounds per concurrency (default 2)")
    ap.add_argument("--concurrency", type=_concurrency,
                    help="comma-separated request counts (default 1,4,8,16)")
    ap.add_argument("--blas", help="comma-separated SPECSERVE_BLAS settings (default auto,reference)")
    ap.add_argument("--max-tokens", type=_at_least_1, help="tokens generated per request (default 64)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: concurrency 1,8, max-tokens 16, repeats 1, blas auto (flags override)")
    ap.add_argument("--full-reference", action="store_true",
                    help="run the reference-BLAS worker with the full plan too (default: concurrency 1,8, "
                         "max-tokens 32, repeats 1, since it is ~10x slower)")
    ap.add_argument("--output-json", default="results/bench_engine.json")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target check fails")


def plan_for(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """Explicit flags win; otherwise the quick, reference or default plan."""
    base = QUICK_PLAN if args.quick else DEFAULT_PLAN
    if setting == "reference" and not args.quick and not args.full_reference:
        base = REFERENCE_PLAN
    plan = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in base.items()}
    plan["concurrency"] = parse_concurrency(str(plan["concurrency"]))
    return plan


def run(args: argparse.Namespace) -> int:
    if args.blas is None:
        args.blas = "auto" if args.quick else "auto,reference"
    args.blas = [b.strip() for b in args.blas.split(",") if b.strip()]
    common = {"kv_cache_memory": args.kv_cache_memory, "max_model_len": args.max_model_len,
              "temperature": 0.0, "ignore_eos": True, "num_prompts": len(PROMPTS),
              "mlx_lm_single": "generate_step",
              "mlx_lm_batch": "BatchGenerator(prefill_batch_size=c, completion_batch_size=max(32, c))"}
    plans = {s: {**plan_for(s, args), **common} for s in args.blas}
    t_start = time.perf_counter()
    workers: list[dict[str, Any]] = []
    for setting in args.blas:
        log(f"== worker SPECSERVE_BLAS={setting}")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "worker.json")
            env = {**os.environ, "SPECSERVE_BLAS": setting}
            cmd = [sys.executable, "-m", "loadtests.engine_bench", "--worker", json.dumps(plans[setting]),
                   "--worker-out", out]
            t0 = time.perf_counter()
            rc = subprocess.run(cmd, env=env).returncode
            if rc != 0 or not os.path.exists(out):
                log(f"worker SPECSERVE_BLAS={setting} failed (exit {rc})")
                return 2
            w = json.loads(Path(out).read_text())
        w["worker_wall_s"] = time.perf_counter() - t0
        med = median_table(w["runs"])
        w["targets"] = target_checks(med)
        w["medians"] = med
        w["medians_decode"] = median_table(w["runs"], "decode_tok_s")
        w["medians_ttft"] = median_table(w["runs"], "ttft_mean_s")
        w["plan"] = plans[setting]
        workers.append(w)
    wall = time.perf_counter() - t_start
    print_report(workers)
    print(f"\nwall time {wall:.0f}s; machine is shared and noisy: read the ratios, not absolute tok/s")
    report = {
        "schema_version": SCHEMA_VERSION,
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "machine": platform.machine(),
                    "python": platform.python_version(), "cpu_count": os.cpu_count()},
        "versions": workers[0]["versions"] if workers else {},
        "model": workers[0]["model"] if workers else {},
        "config": {"plans": plans, "blas_settings": args.blas},
        "wall_s": wall,
        "workers": [{**w, **{k: {str(c): d for c, d in w[k].items()}
                             for k in ("medians", "medians_decode", "medians_ttft")}} for w in workers],
        "medians": {w["setting"]: {str(c): d for c, d in w["medians"].items()} for w in workers},
        "targets": {w["setting"]: w["targets"] for w in workers},
    }
    path = Path(args.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    failed = any(c["pass"] is False for w in workers for c in w["targets"].values())
    return 1 if (args.strict and failed) else 0


if __name__ == "__main__":  # a worker, started by run()
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", metavar="CONFIG_JSON", required=True)
    ap.add_argument("--worker-out", required=True)
    worker_args = ap.parse_args()
    worker_main(json.loads(worker_args.worker), worker_args.worker_out)
