"""The load-test results of docs/load-tests.md: every speculation method and mlx_lm.server, interleaved.

    python -m loadtests suite --update-docs       # full run (~25 min on a 2-core CPU)
    python -m loadtests suite --quick             # off vs ngram, one workload, under 3 minutes

Full mode starts specserve with no speculation, ngram, suffix, draft_model (the target as its own
draft) and mtp (the committed assistant, configs/assistants/smollm2-135m-mtp, K = 1), plus
mlx_lm.server from a side venv (.venv-mlxlm, created on first use) on a float32 copy of the same
weights, and runs single stream and 8/16/32 concurrency on each workload. Outputs go to
results/loadtests/: suite.json (summaries), one PNG per workload, results.md (the tables);
--update-docs copies results.md into docs/load-tests.md between the loadtests markers. Per-request
records go to results/tmp/loadtests/.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from loadtests import plots, report
from loadtests.matrix import MatrixConfig, run_matrix, started
from loadtests.runner import Level
from loadtests.servers import (
    DEFAULT_MTP_ASSISTANT,
    REPO,
    ServerSpec,
    default_model_folder,
    mlxlm_spec,
    specserve_command,
)

DOCS_PAGE = REPO / "docs" / "load-tests.md"
DOCS_START = "<!-- loadtests:results:start -->"
DOCS_END = "<!-- loadtests:results:end -->"
COMMAND = "python -m loadtests suite --update-docs"


def spec_modes(model_folder: str) -> dict[str, dict[str, Any] | None]:
    return {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 5},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8},
        # The target as its own draft: acceptance is ~1 for greedy, so this measures the method's cost.
        "draft_model": {"method": "draft_model", "model": model_folder, "num_speculative_tokens": 3},
        "mtp": {"method": "mtp", "model": DEFAULT_MTP_ASSISTANT, "num_speculative_tokens": 1},
    }


def quick_config() -> MatrixConfig:
    return MatrixConfig(workloads=["copy"], levels=[Level(concurrency=1), Level(concurrency=4)],
                        max_tokens=32, requests_per_slot=1, min_requests=3, duration_s=25, warmup=1)


def full_config() -> MatrixConfig:
    # copy: where ngram / suffix should pay; mixed-temp: chat and copy prompts, half of them sampled,
    # where speculation can cost P99. chat and long are left to `run` to keep this under ~25 minutes.
    return MatrixConfig(workloads=["copy", "mixed-temp"],
                        levels=[Level(concurrency=c) for c in (1, 8, 16, 32)], max_tokens=64,
                        requests_per_slot=1, min_requests=4, duration_s=60, warmup=2)


# ---------------------------------------------------------------------------------------------------
# Markdown


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def results_markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    env = doc["environment"]
    runs = doc["runs"]
    lines = [
        f"Measured {doc['created']} on {env['platform']} ({env['cpu_count']} CPUs, shared: 1-minute load "
        f"{_f(doc.get('load_average_start'), '.1f')} at the start, {_f(env.get('load_average_1m'), '.1f')} "
        f"at the end; {_f(doc.get('wall_s', 0) / 60, '.0f')} min in all), default model "
        f"({doc.get('model', 'SmolLM2-135M-Instruct')}, float32), max_tokens {cfg['max_tokens']}, "
        f"{cfg['min_requests']}+ requests per level (at least one per slot), levels interleaved across "
        f"servers. Throughput is output tokens/s over the level's wall time; TTFT / TPOT / e2e in ms / "
        f"ms / s; acceptance from `/metrics` (rate = accepted / drafted tokens, length = 1 + accepted / "
        f"drafts). `x off` = throughput / specserve without speculation at the same level.",
        "",
    ]
    for d in doc.get("unavailable", []):
        lines.append(f"- **{d['label']}**: not measured, the server did not start: "
                     f"{_short_error(d['error'])}")
    if doc.get("unavailable"):
        lines.append("")
    base = {(r["workload"], lvl["level"]): lvl for r in runs if r["label"] == "off" for lvl in r["levels"]}
    for wl in cfg["workloads"]:
        lines += [f"**Workload `{wl}`** (plot: `results/loadtests/{wl}.png`)", "",
                  "| conc | server | ok/n | tok/s | x off | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | "
                  "e2e p50 | e2e p99 | acc. rate | acc. len |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for key in cfg["levels"]:
            for run in (r for r in runs if r["workload"] == wl):
                lvl = next(x for x in run["levels"] if x["level"] == key)
                b = base.get((wl, key))
                ratio = (lvl["output_throughput_tok_s"] / b["output_throughput_tok_s"]
                         if b and b["output_throughput_tok_s"] and lvl["output_throughput_tok_s"] else None)
                spec = lvl.get("spec_decode") or {}
                lines.append(
                    f"| {lvl['concurrency']} | {run['label']} | {lvl['completed']}/{lvl['num_requests']} | "
                    f"{_f(lvl['output_throughput_tok_s'], '.1f')} | {_f(ratio, '.2f')} | "
                    f"{_ms(lvl['ttft_s']['p50'])} | {_ms(lvl['ttft_s']['p99'])} | "
                    f"{_ms(lvl['tpot_s']['p50'])} | {_ms(lvl['tpot_s']['p99'])} | "
                    f"{_f(lvl['e2e_s']['p50'], '.2f')} | {_f(lvl['e2e_s']['p99'], '.2f')} | "
                    f"{_f(spec.get('acceptance_rate'), '.2f')} | "
                    f"{_f(spec.get('mean_acceptance_length'), '.2f')} |")
        lines += _connection_notes(runs, wl)
        lines.append("")
        lines += _per_position(runs, wl)
    lines += _mlxlm_ratios(runs, cfg)
    return "\n".join(lines).rstrip() + "\n"


def _connection_notes(runs: list[dict[str, Any]], wl: str) -> list[str]:
    notes = []
    for run in runs:
        for lvl in run["levels"] if run["workload"] == wl else []:
            if lvl.get("failed") or lvl.get("retries"):
                errors = f" ({'; '.join(lvl['errors'])})" if lvl.get("errors") else ""
                notes.append(f"{run['label']} at c={lvl['concurrency']}: {lvl.get('retries', 0)} retries, "
                             f"{lvl.get('failed', 0)} failed{errors}")
    if not notes:
        return []
    return ["", "Connections dropped before any response were retried like the openai SDK does (twice, "
            "0.5 s then 1 s back-off; latencies count from the first attempt): " + "; ".join(notes) + "."]


def _short_error(msg: str) -> str:
    parts = [p.strip() for p in msg.split(" | ")]
    return next((p for p in reversed(parts) if "error" in p.lower()), parts[-1])


def _per_position(runs: list[dict[str, Any]], wl: str) -> list[str]:
    from loadtests.prom import merge_spec

    rows = []
    for run in runs:
        specs = [lvl["spec_decode"] for lvl in run["levels"] if lvl.get("spec_decode")]
        if run["workload"] == wl and specs:
            rows.append((run["label"], merge_spec(specs)))
    if not rows:
        return []
    width = max(len(s["acceptance_rate_per_position"]) for _, s in rows)
    out = [f"Per-position acceptance (`{wl}`, all levels pooled; accepted at position i / drafts):", "",
           "| server | drafts | " + " | ".join(f"pos {i + 1}" for i in range(width)) + " |",
           "|---|---:|" + "---:|" * width]
    for label, s in rows:
        rates = s["acceptance_rate_per_position"] + [None] * (width - len(s["acceptance_rate_per_position"]))
        out.append(f"| {label} | {s['num_drafts']} | " + " | ".join(_f(r, ".2f") for r in rates) + " |")
    return out + [""]


def _mlxlm_ratios(runs: list[dict[str, Any]], cfg: dict[str, Any]) -> list[str]:
    idx = {(r["label"], r["workload"]): r for r in runs}
    other = next((r["label"] for r in runs if r["label"].startswith("mlx_lm")), None)
    if other is None:
        return []
    out = [f"**specserve (no speculation) / {other}**, same workload, model and dtype (above 1: specserve "
           "has more throughput, or higher latency):", "",
           "| workload | conc | tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | e2e p99 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for wl in cfg["workloads"]:
        a, b = idx.get(("off", wl)), idx.get((other, wl))
        if not a or not b:
            continue
        for la, lb in zip(a["levels"], b["levels"], strict=True):
            cells = []
            for key, sub in (("output_throughput_tok_s", None), ("ttft_s", "p50"), ("ttft_s", "p99"),
                             ("tpot_s", "p50"), ("tpot_s", "p99"), ("e2e_s", "p99")):
                va = la[key] if sub is None else la[key][sub]
                vb = lb[key] if sub is None else lb[key][sub]
                cells.append(_f(va / vb if va is not None and vb else None, ".2f"))
            out.append(f"| {wl} | {la['concurrency']} | " + " | ".join(cells) + " |")
    return out + [""]


def update_docs(markdown: str, page: Path = DOCS_PAGE) -> bool:
    """Replace only the text between the markers of the load-test page."""
    text = page.read_text()
    if DOCS_START not in text or DOCS_END not in text:
        print(f"{page}: no {DOCS_START} ... {DOCS_END} markers; left alone")
        return False
    head, rest = text.split(DOCS_START, 1)
    _, tail = rest.split(DOCS_END, 1)
    page.write_text(f"{head}{DOCS_START}\n{markdown}{DOCS_END}{tail}")
    return True


# ---------------------------------------------------------------------------------------------------


def render(doc_path: Path, update: bool) -> int:
    """Tables and plots again from a suite.json, without measuring (e.g. after a formatting change)."""
    doc = report.load_json(doc_path)
    out = doc_path.parent
    md = results_markdown(doc)
    (out / "results.md").write_text(md)
    plots.plot_by_workload(doc["runs"], out, title=_title(doc["runs"]))
    print(md)
    if update and update_docs(md):
        print(f"{DOCS_PAGE} results updated")
    return 0


def _title(runs: list[dict[str, Any]]) -> str:
    other = any(r["label"].startswith("mlx_lm") for r in runs)
    return "specserve: speculation on vs off" + (" and mlx_lm.server" if other else "") + ";"


def run_suite(args: argparse.Namespace) -> int:
    if args.render:
        return render(Path(args.render), args.update_docs)
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]  # other work on a shared machine shows up here
    cfg = quick_config() if args.quick else full_config()
    if args.max_tokens:
        cfg.max_tokens = args.max_tokens
    out = Path(args.output_dir or ("results/tmp/loadtests/quick" if args.quick else "results/loadtests"))
    tmp = Path("results/tmp/loadtests/suite-quick" if args.quick else "results/tmp/loadtests/suite")
    folder = default_model_folder()
    modes = spec_modes(folder)
    names = args.modes.split(",") if args.modes else (["off", "ngram"] if args.quick else list(modes))
    specs = [ServerSpec(label=m, command=specserve_command(modes[m])) for m in names]
    if not args.quick and not args.skip_mlxlm:
        specs.append(mlxlm_spec())
    with started(specs, tmp / "logs") as (up, down):
        runs = run_matrix(up, cfg)
    extra = {"unavailable": down, "load_average_start": load_start, "model": "SmolLM2-135M-Instruct",
             "model_folder": folder,
             "command": COMMAND + (" --quick" if args.quick else ""),
             "wall_s": round(time.monotonic() - t_start, 1)}
    doc = report.result_document("suite", cfg.to_json(), runs, extra)
    report.write_json(doc, tmp / "suite-requests.json")
    report.write_json(doc, out / "suite.json", keep_requests=False)
    pngs = plots.plot_by_workload(runs, out, title=_title(runs))
    md = results_markdown(json.loads((out / "suite.json").read_text()))
    (out / "results.md").write_text(md)
    print()
    print(report.format_table(report.flat_levels(runs), report.level_columns()))
    print(f"\nwrote {out / 'suite.json'}, {out / 'results.md'}, {', '.join(map(str, pngs))} "
          f"in {doc['wall_s']:.0f} s")
    if args.update_docs and not args.quick and update_docs(md):
        print(f"{DOCS_PAGE} results updated")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("suite", help="the load-test results: all speculation methods and mlx_lm.server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="off vs ngram, copy workload, c=1,4, < 3 minutes")
    p.add_argument("--modes", default=None, help="comma-separated subset of off,ngram,suffix,draft_model,mtp")
    p.add_argument("--skip-mlxlm", action="store_true", help="do not install / run mlx_lm.server")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--update-docs", action="store_true", help="rewrite the results in docs/load-tests.md")
    p.add_argument("--render", metavar="SUITE_JSON", default=None,
                   help="only rebuild results.md and the plots (the docs page too with --update-docs) from a "
                        "suite.json")
    p.set_defaults(func=run_suite)
