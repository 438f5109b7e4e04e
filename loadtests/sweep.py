"""`specserve bench sweep`: several servers, the same datasets and load levels, interleaved; B/A ratios.

Servers are modes (`--modes off,ngram`: `specserve serve` with that config's speculative config, see
loadtests/modes.py), static-K variants of them (`--k 1,2,4`), any command line or running server
(`--server LABEL=COMMAND|URL`) and mlx_lm.server (`--mlx-lm`). All are started on loopback first and
stay up; for every level each runs once per round, the order alternating, so drift in the machine's
speed hits them alike. Writes sweep.json, results.md (the tables) and one PNG per dataset.

`--temperatures 0,0.4,0.8,1.0` adds a third axis: every level runs once per temperature, every request
at it (each item with a fixed seed), the same prompts at every temperature (the specserve servers it
starts run without prefix caching, so each temperature prefills them afresh); results.md gets a
temperature column and DATASET-temperature.png plots acceptance, tokens/s and its ratio, TTFT, TPOT
and e2e latency against temperature. Datasets whose items carry a class (extraction-creative,
mixed-temp, custom with "class") also get a table per class.

Ratios, per dataset and level: throughput / the base server's (`--base`, default off where it runs,
else the first) and / the best other server's, pooled and per round (a ratio within one round does not
drift with the machine; their spread says how far one round can be trusted). "auto must never lose" reads as
`x best other >= 1` for an adaptive mode run beside off and its static Ks.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from loadtests import modes as modes_mod
from loadtests import plots, report
from loadtests.datasets import load_dataset
from loadtests.matrix import MatrixConfig, run_matrix, started
from loadtests.prom import merge_spec
from loadtests.runner import Level
from loadtests.servers import ServerSpec, mlxlm_spec, server_spec, specserve_command

DEFAULT_OUT = Path("results/tmp/bench-sweep")
NO_PREFIX_CACHING = "--no-enable-prefix-caching"


def levels_of(rates: list[float], concurrencies: list[int | None],
              temperatures: list[float | None] | None = None) -> list[Level]:
    """Every (rate, concurrency, temperature), the temperature innermost: a load level's temperatures
    run one after the other and sit side by side in the tables."""
    return [Level(request_rate=r, max_concurrency=c, temperature=t)
            for r in rates for c in concurrencies for t in (temperatures or [None])]


def server_specs(args: argparse.Namespace, out: Path) -> list[ServerSpec]:
    others = bool(args.server or args.speculative_config)
    try:
        chosen = modes_mod.from_flags(args.modes, args.k, args.speculative_config,
                                      default=[] if others else modes_mod.available())
    except ValueError as e:
        raise SystemExit(str(e)) from None
    serve_args = shlex.split(args.serve_args) if args.serve_args else []
    if getattr(args, "temperatures", None) and not any("prefix-caching" in a for a in serve_args):
        # A level's temperatures share prompts: uncached, each prefills them afresh and TTFTs compare.
        serve_args.append(NO_PREFIX_CACHING)
    specs = [ServerSpec(label=label,
                        command=specserve_command(spec, extra=[*serve_args, *_trace(out, label, args)]))
             for label, spec in chosen.items()]
    specs += [server_spec(*modes_mod.parse_labelled(s)) for s in args.server]
    if args.mlx_lm:
        specs.append(mlxlm_spec())
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"server labels must differ: {labels}")
    return specs


def _trace(out: Path, label: str, args: argparse.Namespace) -> list[str]:
    """`--step-trace` for one specserve server: OUTPUT/logs/<label>.steps.jsonl, started afresh."""
    if not args.step_traces:
        return []
    path = out / "logs" / f"{report.slug(label)}.steps.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # the server appends
    return ["--step-trace", str(path)]


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# ---------------------------------------------------------------------------------------------------
# Ratios and tables


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(runs: list[dict[str, Any]], base: str) -> list[dict[str, Any]]:
    """One row per dataset, level and server: its throughput over the base server's and over the best
    other server's (pooled, and round by round), its P99 TPOT over the base's, and per request class
    its throughput over the base's for that class."""
    by = {(r["label"], r["dataset"]): r for r in runs}
    labels = list(dict.fromkeys(r["label"] for r in runs))
    rows = []
    for ds in dict.fromkeys(r["dataset"] for r in runs):
        present = [lab for lab in labels if (lab, ds) in by]
        for i, head in enumerate(by[(present[0], ds)]["levels"]):
            lv = {lab: by[(lab, ds)]["levels"][i] for lab in present}
            tput = {lab: lv[lab]["output_throughput_tok_s"] or 0.0 for lab in present}
            per_round = {lab: [x or 0.0 for x in lv[lab].get("round_throughput_tok_s") or [tput[lab]]]
                         for lab in present}
            for lab in present:
                others = [o for o in present if o != lab]
                best = max((tput[o] for o in others), default=None)
                rounds = range(len(per_round[lab]))
                rows.append({
                    "dataset": ds, "level": head["level"], "label": lab, "tok_s": tput[lab],
                    "vs_base": _div(tput[lab], tput.get(base)) if lab != base else None,
                    "vs_best_other": _div(tput[lab], best),
                    "vs_base_rounds": [_div(per_round[lab][j], _at(per_round.get(base), j)) for j in rounds]
                    if lab != base and base in per_round else [],
                    "vs_best_other_rounds": [_div(per_round[lab][j], max((_at(per_round[o], j) or 0.0)
                                                                         for o in others))
                                             for j in rounds] if others else [],
                    "tpot_p99_vs_base": _div(lv[lab]["tpot_ms"]["p99"], lv[base]["tpot_ms"]["p99"])
                    if lab != base and base in lv else None,
                    "classes_vs_base": {c: _div(cls["output_throughput_tok_s"],
                                                _class(lv[base], c).get("output_throughput_tok_s"))
                                        for c, cls in (lv[lab].get("classes") or {}).items()}
                    if lab != base and base in lv else {}})
    return rows


def _class(level: dict[str, Any], name: str) -> dict[str, Any]:
    return (level.get("classes") or {}).get(name) or {}


def _at(values: list[float] | None, i: int) -> float | None:
    return values[i] if values is not None and i < len(values) else None


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(doc: dict[str, Any]) -> str:
    cfg, env, runs, base = doc["config"], doc["environment"], doc["runs"], doc["base"]
    req = cfg["request"]
    lines = [
        f"Measured {doc['created']} on {env['platform']} ({env['cpu_count']} CPUs, 1-minute load "
        f"{_f(doc.get('load_average_start'), '.1f')} at the start, "
        f"{_f(env.get('load_average_1m'), '.1f')} at the end; {_f(doc.get('wall_s', 0) / 60, '.0f')} min), "
        f"max_tokens {req['max_tokens']}, "
        f"{cfg['rounds']} round(s) per level, servers interleaved. Throughput: output tokens/s over the "
        f"level's wall time; latencies in ms; acceptance from `/metrics` (rate = accepted / drafted tokens, "
        f"length = 1 + accepted / drafts). `x {base}` = throughput / {base}'s; `x best other` = throughput / "
        f"the best other server's at the same level.", ""]
    lines += [f"- **{d['label']}**: not measured, the server did not start: {d['error']}"
              for d in doc.get("unavailable", [])]
    rows = {(r["dataset"], r["level"], r["label"]): r for r in doc["ratios"]}
    with_temp = any(lvl.get("temperature") is not None for run in runs for lvl in run["levels"])
    if with_temp:
        uncached = [run["label"] for run in runs if NO_PREFIX_CACHING in (run.get("command") or [])]
        lines += ["Every request of a `temp` row is sampled at that temperature (a fixed seed per prompt), "
                  "the same prompts at every temperature of a level. `drafted` = draft tokens proposed. "
                  + (f"Without prefix caching ({', '.join(dict.fromkeys(uncached))}): every temperature "
                     "prefills its prompts afresh." if uncached else
                     "With prefix caching, later temperatures find a level's prompts cached: compare TTFT "
                     "between servers at one temperature.")]
    for ds in cfg["datasets"]:
        lines += ["", f"**Dataset `{ds}`**", "",
                  f"| level | {'temp | ' if with_temp else ''}server | ok/n | tok/s | x {base} | "
                  "x best other | x best other, per round | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | "
                  "e2e p99 | drafted | acc. rate | acc. len |",
                  f"|---|{'---:|' if with_temp else ''}---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"
                  "---:|---:|---:|"]
        for key in cfg["levels"]:
            for run in (r for r in runs if r["dataset"] == ds):
                lvl = next(x for x in run["levels"] if x["level"] == key)
                ratio = rows[(ds, key, run["label"])]
                spec = lvl.get("spec_decode") or {}
                per_round = " ".join(_f(x) for x in ratio["vs_best_other_rounds"]) or "-"
                lines.append(
                    f"| {_level_cells(lvl, with_temp)} | {run['label']} | "
                    f"{lvl['completed']}/{lvl['num_requests']} | "
                    f"{_f(lvl['output_throughput_tok_s'], '.1f')} | {_f(ratio['vs_base'])} | "
                    f"{_f(ratio['vs_best_other'])} | {per_round} | "
                    + _ms(lvl, (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"),
                                ("tpot_ms", "p99"), ("e2e_ms", "p99")))
                    + f" | {_f(spec.get('num_draft_tokens'), 'd')} | {_f(spec.get('acceptance_rate'))} | "
                    f"{_f(spec.get('mean_acceptance_length'))} |")
        lines += _per_class(runs, ds, cfg["levels"], rows, base, with_temp)
        lines += _connection_notes(runs, ds) + _per_position(runs, ds)
    return "\n".join(lines).rstrip() + "\n"


def _level_cells(lvl: dict[str, Any], with_temp: bool) -> str:
    """The level's cells: "c8", or "c8 | 0.4" where the table has a temperature column."""
    if not with_temp:
        return str(lvl["level"])
    t = lvl.get("temperature")
    return f"{report.load_key(lvl)} | {'own' if t is None else format(t, 'g')}"


def _ms(d: dict[str, Any], keys: tuple[tuple[str, str], ...]) -> str:
    return " | ".join(_f(d[k][p], ".0f") for k, p in keys)


def _per_class(runs: list[dict[str, Any]], ds: str, levels: list[str], rows: dict[tuple[str, str, str], Any],
               base: str, with_temp: bool) -> list[str]:
    """Per level, class and server: the class's requests alone (datasets whose items carry a class)."""
    sel = [run for run in runs if run["dataset"] == ds]
    if not any(lvl.get("classes") for run in sel for lvl in run["levels"]):
        return []
    out = ["", f"Per class (`{ds}`): each class's requests alone; tok/s = the class's output tokens over the "
           f"level's wall time (the classes add up to the level's), `x {base}` = that over {base}'s for the "
           "same class.", "",
           f"| level | {'temp | ' if with_temp else ''}class | server | ok/n | tok/s | x {base} | TTFT p50 | "
           "TTFT p99 | TPOT p50 | TPOT p99 | e2e p50 | e2e p99 |",
           f"|---|{'---:|' if with_temp else ''}---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    keys = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("tpot_ms", "p99"), ("e2e_ms", "p50"),
            ("e2e_ms", "p99"))
    for key in levels:
        lvls = {run["label"]: next(x for x in run["levels"] if x["level"] == key) for run in sel}
        for name in dict.fromkeys(c for lvl in lvls.values() for c in lvl.get("classes") or {}):
            for label, lvl in lvls.items():
                cls = _class(lvl, name)
                if not cls:
                    continue
                ratio = (rows[(ds, key, label)].get("classes_vs_base") or {}).get(name)
                out.append(f"| {_level_cells(lvl, with_temp)} | {name} | {label} | "
                           f"{cls['completed']}/{cls['num_requests']} | "
                           f"{_f(cls['output_throughput_tok_s'], '.1f')} | {_f(ratio)} | {_ms(cls, keys)} |")
    return out


def _connection_notes(runs: list[dict[str, Any]], ds: str) -> list[str]:
    notes = [f"{run['label']} at {lvl['level']}: {lvl.get('retries', 0)} retries, "
             f"{lvl.get('failed', 0)} failed"
             + (f" ({'; '.join(lvl['errors'])})" if lvl.get("errors") else "")
             for run in runs if run["dataset"] == ds for lvl in run["levels"]
             if lvl.get("failed") or lvl.get("retries")]
    if not notes:
        return []
    return ["", "Connections dropped before any response were retried as the openai SDK does (twice, 0.5 s "
            "then 1 s back-off; latencies count from the first attempt): " + "; ".join(notes) + "."]


def _per_position(runs: list[dict[str, Any]], ds: str) -> list[str]:
    rows = []
    for run in runs:
        specs = [lvl["spec_decode"] for lvl in run["levels"] if lvl.get("spec_decode")]
        if run["dataset"] == ds and specs:
            rows.append((run["label"], merge_spec(specs)))
    rows = [(label, s) for label, s in rows if s["num_drafts"]]
    if not rows:
        return []
    width = max(len(s["acceptance_rate_per_position"]) for _, s in rows)
    out = ["", f"Per-position acceptance (`{ds}`, all levels pooled; accepted at position i / drafts):", "",
           "| server | drafts | " + " | ".join(f"pos {i + 1}" for i in range(width)) + " |",
           "|---|---:|" + "---:|" * width]
    for label, s in rows:
        rates = s["acceptance_rate_per_position"] + [None] * (width - len(s["acceptance_rate_per_position"]))
        out.append(f"| {label} | {s['num_drafts']} | " + " | ".join(_f(r) for r in rates) + " |")
    return out


def emit(doc: dict[str, Any], out: Path) -> list[Path]:
    """results.md and the plots from a sweep document; prints the tables."""
    md = markdown(doc)
    (out / "results.md").write_text(md)
    pngs = plots.plot_by_dataset(doc["runs"], out, title=f"specserve bench sweep (base: {doc['base']});",
                                 base=doc["base"])
    print()
    print(report.format_table(report.flat_levels(doc["runs"]), report.level_columns()))
    print()
    print(md)
    return [out / "results.md", *pngs]


def temperature_axis(args: argparse.Namespace, datasets: list[str]) -> list[float | None] | None:
    """`--temperatures` as a list (None: each item's own temperature), checked against the datasets."""
    if not args.temperatures:
        return None
    temps: list[float | None] = [float(t) for t in _csv(args.temperatures)]
    if any(t is not None and t < 0 for t in temps):
        raise SystemExit(f"--temperatures must be >= 0, got {args.temperatures}")
    if args.request.temperature is not None:
        raise SystemExit("--temperature fixes one temperature, --temperatures sweeps several: not both")
    own = [ds for ds in datasets if any(it.temperature for it in load_dataset(ds, args.data))]
    if own:
        raise SystemExit(f"{', '.join(own)} set their own temperatures, which --temperatures would replace: "
                         "sweep datasets that leave temperature to the run (copy, chat, long, random)")
    return temps


def run(args: argparse.Namespace) -> int:
    if args.render:
        path = Path(args.render)
        written = emit(report.load_json(path), path.parent)
        print(f"wrote {', '.join(map(str, written))}")
        return 0
    out = Path(args.output_dir)
    t0, load = time.monotonic(), os.getloadavg()[0]
    specs = server_specs(args, out)
    rates = [float(r) for r in _csv(args.request_rate)]
    concurrency: list[int | None]
    if args.max_concurrency:
        concurrency = [int(c) for c in _csv(args.max_concurrency)]
    else:
        concurrency = [None] if any(not math.isinf(r) for r in rates) else [1, 8, 16, 32]
    datasets = _csv(args.dataset_name)
    temperatures = temperature_axis(args, datasets)
    cfg = MatrixConfig(datasets=datasets, levels=levels_of(rates, concurrency, temperatures),
                       request=args.request, data=args.data,
                       prompts_per_slot=args.prompts_per_slot, num_prompts=args.num_prompts,
                       duration_s=args.duration, rounds=args.rounds, warmup=args.num_warmups)
    # `timeout` and kill send SIGTERM: exit through `started`'s clean-up, or the servers outlive us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with started(specs, out / "logs") as (up, down):
        if not up:
            print("no server started", file=sys.stderr)
            return 2
        runs = run_matrix(up, cfg)
    labels = [r["label"] for r in runs]
    base = args.base or ("off" if "off" in labels else labels[0])
    if base not in {r["label"] for r in runs}:
        raise SystemExit(f"--base {base!r} is not one of the servers measured")
    doc = report.result_document("sweep", cfg.to_json(), runs, {
        "base": base, "ratios": ratios(runs, base), "unavailable": down, "load_average_start": load,
        "wall_s": round(time.monotonic() - t0, 1)})
    report.write_json(doc, out / "sweep.json", keep_requests=args.save_detailed)
    written = emit(doc, out)
    print(f"wrote {out / 'sweep.json'}, {', '.join(map(str, written))}")
    return 1 if down else 0
