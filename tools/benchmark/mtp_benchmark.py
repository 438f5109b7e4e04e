"""Single-stream greedy benchmark of MTP assistants on held-out chat prompts (table + JSON).

    python -m tools.benchmark.mtp_benchmark --assistant configs/assistants/smollm2-135m-mtp \
        --k 1,3 --num-prompts 8 --max-tokens 64 --output-json results/mtp/smollm2.json

Variants (no speculation, MTP with each K and each `--min-token-prob` cut-off, optionally a draft
model) share one loaded target and run interleaved prompt by prompt, one request at a time, so machine
load hits them alike. Per-position acceptance is counted from the engine's stats
(`spec_benchmark.run_batch`); greedy token ids must be identical across variants (checked).

With `--check-metrics`, each speculative variant is then served by a real `specserve serve` on loopback
and the same prompts are sent one at a time through `/v1/completions`; the deltas of `/metrics`'
`vllm:spec_decode_*` counters (per position included) must equal the offline run's own counts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--assistant", default=str(ROOT / "configs" / "assistants" / "smollm2-135m-mtp"),
                   help="assistant folder; several, comma-separated, run as variants of their own "
                        "(named [folder]), interleaved with the others")
    p.add_argument("--k", default="1,3", help="comma-separated num_speculative_tokens values ('auto' too)")
    p.add_argument("--min-token-prob", default="",
                   help="comma-separated draft_min_token_prob values, each one cut-off or one per position "
                        "joined by '/' (0.35/0.15); each K runs once per value (default: the key left out, "
                        "i.e. 0)")
    p.add_argument("--assistant-pass", default="auto",
                   help="comma-separated: auto (what the engine picks), c (engine/cpu/mtp.c), mlx (the "
                        "MLX module, SPECSERVE_MTP_CPU=0); several run as variants of their own, interleaved")
    p.add_argument("--draft-model", default=None, help="also run method draft_model with this model")
    p.add_argument("--prompts", default=str(ROOT / "configs" / "train_prompts_heldout.jsonl"))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--output-json", default=None)
    p.add_argument("--check-metrics", action="store_true",
                   help="serve each speculative variant and compare /metrics deltas with the offline counts")
    args = p.parse_args(argv)

    import engine  # noqa: F401 - MKL before mlx
    from engine.llm import LLM
    from engine.models.loader import load_model
    from engine.sampling import SamplingParams
    from tools.benchmark.spec_benchmark import run_batch

    target = load_model(None, dtype="float32", progress=False)
    kw: dict[str, Any] = dict(kv_cache_memory="512MiB", max_model_len=2048, show_progress=False)
    configs: dict[str, dict[str, Any]] = {}
    cuts: list[list[float] | None] = [[float(v) for v in x.split("/")] for x in args.min_token_prob.split(",")
                                      if x.strip()] or [None]
    assistants = [a.strip() for a in args.assistant.split(",") if a.strip()]
    ks = [x.strip() for x in args.k.split(",") if x.strip()]
    passes = [x.strip() for x in args.assistant_pass.split(",") if x.strip()]
    pass_of: dict[str, str] = {}
    for k, cut, assistant, how in itertools.product(ks, cuts, assistants, passes):
        base: dict[str, Any] = {"method": "mtp", "model": assistant}
        name = f"mtp-k{k}" if k != "auto" else "mtp-auto"
        if len(assistants) > 1:
            name += f"[{Path(assistant).name}]"
        if len(passes) > 1:
            name += f"[{how}]"
        if cut is not None:
            base["draft_min_token_prob"] = cut[0] if len(cut) == 1 else cut
            name += "-p" + "/".join(f"{c:g}" for c in cut)
        pass_of[name] = how
        if k == "auto":  # the adaptive controller, K up to 3
            configs[name] = {**base, "num_speculative_tokens": "auto",
                             "adaptive": {"max_num_speculative_tokens": 3}}
        else:
            configs[name] = {**base, "num_speculative_tokens": int(k)}
    if args.draft_model:
        configs["draft_model-k3"] = {"method": "draft_model", "model": args.draft_model,
                                     "num_speculative_tokens": 3}
    variants: dict[str, Any] = {"baseline": LLM(loaded=target, **kw)}
    user_choice = os.environ.get("SPECSERVE_MTP_CPU")
    used: dict[str, str] = {}  # MTP variant -> how its assistant passes ran
    for name, cfg in configs.items():
        how = pass_of.get(name, "auto")
        choice = {"mlx": "0", "c": "auto"}.get(how, user_choice or "auto")
        os.environ["SPECSERVE_MTP_CPU"] = choice
        variants[name] = LLM(loaded=target, speculative_config=cfg, **kw)  # the proposer reads it here
        proposer = variants[name].core.proposer
        if cfg["method"] == "mtp":
            used[name] = "C" if proposer.cpu is not None else f"MLX ({proposer.cpu_reason})"
        if how != "auto" and used.get(name, "").startswith("C") != (how == "c"):
            raise SystemExit(f"{name}: asked for the {how} assistant pass, got {used.get(name)}")
    if user_choice is None:
        os.environ.pop("SPECSERVE_MTP_CPU", None)
    else:
        os.environ["SPECSERVE_MTP_CPU"] = user_choice
    lines = Path(args.prompts).read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    texts = texts[: args.num_prompts]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm0 = variants["baseline"]
    prompts = [llm0.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    for name, llm in variants.items():  # warm-up (compiles, allocates)
        run_batch(llm, [prompts[0]], SamplingParams(max_tokens=8, temperature=0.0), f"warm-{name}")
    res: dict[str, dict[str, Any]] = {n: {"elapsed_s": 0.0, "tokens": 0, "drafts": 0, "draft_tokens": 0,
                                          "accepted_per_position": [], "token_ids": []} for n in variants}
    for i, prompt in enumerate(prompts):
        for name, llm in variants.items():
            out = run_batch(llm, [prompt], greedy, f"{name}-{i}")
            r = res[name]
            r["elapsed_s"] += out["elapsed_s"]
            r["tokens"] += out["output_tokens"]
            r["token_ids"].append(out["token_ids"][0])
            if out["spec"]:
                r["drafts"] += out["spec"]["num_drafts"]
                r["draft_tokens"] += out["spec"]["num_draft_tokens"]
                pp = out["spec"]["accepted_per_position"]
                acc = r["accepted_per_position"]
                acc.extend([0] * (len(pp) - len(acc)))
                for j, n in enumerate(pp):
                    acc[j] += n
    base = res["baseline"]
    rows = []
    for name, r in res.items():
        tps = r["tokens"] / r["elapsed_s"]
        per_pos = [n / r["drafts"] for n in r["accepted_per_position"]] if r["drafts"] else []
        rows.append({"variant": name, "output_tokens": r["tokens"], "elapsed_s": round(r["elapsed_s"], 3),
                     "tokens_per_s": round(tps, 2),
                     "speedup": round(tps / (base["tokens"] / base["elapsed_s"]), 3),
                     "drafts": r["drafts"], "draft_tokens": r["draft_tokens"],
                     "accepted_per_position": r["accepted_per_position"],
                     "acceptance_per_position": [round(x, 3) for x in per_pos],
                     "greedy_identical_to_baseline": r["token_ids"] == base["token_ids"]})
    print(markdown(rows))
    checks = {}
    if args.check_metrics:
        variants.clear()  # the offline engines (and their KV caches) go before servers start
        for row in rows[1:]:
            if configs[row["variant"]]["num_speculative_tokens"] == "auto":
                continue  # K follows live step timings: a second run drafts differently by design
            checks[row["variant"]] = metrics_check(configs[row["variant"]], prompts, args.max_tokens, row)
            print(f"/metrics vs offline counts, {row['variant']}: {checks[row['variant']]}")
    doc = {"benchmark": "specserve.mtp_benchmark", "command": [sys.executable, "-m",
                                                             "tools.benchmark.mtp_benchmark", *sys.argv[1:]],
           "assistant": args.assistant, "prompts": texts, "max_tokens": args.max_tokens, "results": rows,
           "assistant_pass": used,
           "metrics_check": checks}
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(doc, indent=1) + "\n")
    ok = all(r["greedy_identical_to_baseline"] for r in rows) and all(c["agree"] for c in checks.values())
    return 0 if ok else 1


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | tok/s | speedup | drafts | acceptance per position | mean acceptance length | "
             "greedy identical |", "|---|---:|---:|---:|---|---:|---|"]
    for r in rows:
        acc = ", ".join(f"{x:.2f}" for x in r["acceptance_per_position"]) or "-"
        length = f"{1 + sum(r['accepted_per_position']) / r['drafts']:.2f}" if r["drafts"] else "-"
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {r['drafts']} | "
                     f"{acc} | {length} | {'yes' if r['greedy_identical_to_baseline'] else 'NO'} |")
    return "\n".join(lines)


def metrics_check(cfg: dict[str, Any], prompts: list[list[int]], max_tokens: int,
                  row: dict[str, Any]) -> dict[str, Any]:
    """Serve `cfg`, send the prompts one at a time, and diff the server's spec-decode counters."""
    import httpx

    from loadtests.prom import parse_spec_counters
    from loadtests.servers import ServerProcess, ServerSpec, specserve_command

    spec = ServerSpec("mtp-check", specserve_command(cfg, kv_cache_memory="512MiB"))
    with ServerProcess(spec, Path("results/tmp/mtp_benchmark_server.log")) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as client:
        before = parse_spec_counters(client.get("/metrics").text)
        for prompt in prompts:
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
        after = parse_spec_counters(client.get("/metrics").text)
    if before is None or after is None:
        return {"agree": False, "error": "no vllm:spec_decode_* series in /metrics"}
    d = after.minus(before)
    server = {"drafts": int(d.drafts), "draft_tokens": int(d.draft_tokens),
              "accepted_per_position": [int(d.per_pos[p]) for p in sorted(d.per_pos)]}
    offline = {"drafts": row["drafts"], "draft_tokens": row["draft_tokens"],
               "accepted_per_position": row["accepted_per_position"]}
    # The server exposes every position up to K; positions nothing was accepted at count 0 there.
    n = len(server["accepted_per_position"])
    offline["accepted_per_position"] = (offline["accepted_per_position"] + [0] * n)[:n]
    return {"agree": server == offline, "server": server, "offline": offline}


if __name__ == "__main__":
    sys.exit(main())
