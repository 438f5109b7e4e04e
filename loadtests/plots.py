"""PNG plots (matplotlib, a dev dependency: imported only when a plot is asked for).

- `plot_runs`: output throughput and P99 TPOT against load, one line per server (`bench sweep`).
- `plot_temperatures`: acceptance, throughput (and its ratio to the base server) and TTFT / TPOT / e2e
  P50 and P99 against temperature, one line per server and load level (`bench sweep --temperatures`).
- `plot_latencies`: the distribution of TTFT, TPOT, ITL and e2e latency of one run (`bench serve`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from loadtests.report import load_key

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("plots need matplotlib: pip install matplotlib (or the dev extra)") from e
    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    fig.clf()
    return out


def _x(level: dict[str, Any]) -> float | None:
    rate = level.get("request_rate")
    return level.get("max_concurrency") if rate is None else rate


def plot_runs(runs: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """`runs`: [{"label", "levels": [level summary, ...]}] for one dataset."""
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    fig, (ax_tp, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_rate = any(lvl.get("request_rate") is not None for run in runs for lvl in run["levels"])
    ticks = sorted({x for run in runs for lvl in run["levels"] if (x := _x(lvl)) is not None})
    for run in runs:
        pts = sorted((x, lvl) for lvl in run["levels"] if (x := _x(lvl)) is not None and lvl["completed"])
        if not pts:
            continue
        xs = [x for x, _ in pts]
        style = "--" if "mlx" in run["label"] else "-"  # other servers dashed, ours solid
        ax_tp.plot(xs, [lvl["output_throughput_tok_s"] for _, lvl in pts], style, marker="o",
                   label=run["label"])
        tpot = [lvl["tpot_ms"]["p99"] if lvl["tpot_ms"]["p99"] is not None else float("nan")
                for _, lvl in pts]
        ax_tpot.plot(xs, tpot, style, marker="o", label=run["label"])
    xlabel = "request rate (req/s, Poisson)" if by_rate else "concurrency (requests in flight)"
    for ax, ylabel in ((ax_tp, "output throughput (tokens/s)"), (ax_tpot, "P99 TPOT (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if not by_rate and ticks and min(ticks) > 0:
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_tp.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    out = _save(fig, path)
    plt.close(fig)
    return out


def plot_by_dataset(runs: list[dict[str, Any]], out_dir: str | Path, prefix: str = "",
                    title: str = "", base: str | None = None) -> list[Path]:
    """Per dataset found in `runs`: <prefix><dataset>.png against load (one line per server and
    temperature), and with several temperatures <prefix><dataset>-temperature.png against them (ratios
    to `base`, default the first server). A temperature sweep at one load level has no load plot."""
    paths = []
    for ds in dict.fromkeys(run["dataset"] for run in runs):
        sel = [run for run in runs if run["dataset"] == ds]
        temps = list(dict.fromkeys(lvl.get("temperature") for run in sel for lvl in run["levels"]))
        loads = {load_key(lvl) for run in sel for lvl in run["levels"]}
        name = f"{title} dataset: {ds}".strip()
        if len(temps) > 1:
            paths.append(plot_temperatures(sel, Path(out_dir) / f"{prefix}{ds}-temperature.png",
                                           base=base or sel[0]["label"], title=name))
        if len(temps) == 1 or len(loads) > 1:
            paths.append(plot_runs(_by_temperature(sel, temps), Path(out_dir) / f"{prefix}{ds}.png",
                                   title=name))
    return paths


def _by_temperature(runs: list[dict[str, Any]], temps: list[float | None]) -> list[dict[str, Any]]:
    """With several temperatures, one pseudo-run per server and temperature ("ngram t=0.4")."""
    if len(temps) == 1:
        return runs
    return [{**run, "label": f"{run['label']} t={'own' if t is None else format(t, 'g')}",
             "levels": [lvl for lvl in run["levels"] if lvl.get("temperature") == t]}
            for run in runs for t in temps]


def _acceptance(level: dict[str, Any]) -> float:
    """The acceptance rate; 0 where the server counts drafts but drafted nothing (sampled requests
    that skip drafting), nan where it has no counters."""
    spec = level.get("spec_decode")
    if not spec:
        return math.nan
    rate = spec.get("acceptance_rate")
    return rate if rate is not None else (0.0 if not spec.get("num_draft_tokens") else math.nan)


def plot_temperatures(runs: list[dict[str, Any]], path: str | Path, base: str, title: str = "") -> Path:
    """`runs`: one dataset's, levels with a temperature each; one colour per server and load level."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.6))
    loads = list(dict.fromkeys(load_key(lvl) for run in runs for lvl in run["levels"]))
    base_run = next((run for run in runs if run["label"] == base), None)
    base_tput = {lvl["level"]: lvl["output_throughput_tok_s"] for lvl in (base_run or {}).get("levels", [])}
    colour = 0
    for run in runs:
        for load in loads:
            pts = sorted((lvl["temperature"], lvl) for lvl in run["levels"]
                         if load_key(lvl) == load and lvl.get("temperature") is not None and lvl["completed"])
            if not pts:
                continue
            xs, lvls = [t for t, _ in pts], [lvl for _, lvl in pts]
            style = {"color": f"C{colour % 10}", "marker": "o"}
            colour += 1
            label = run["label"] + (f" {load}" if len(loads) > 1 else "")
            axes[0][0].plot(xs, [_acceptance(lvl) for lvl in lvls], label=label, **style)
            axes[0][1].plot(xs, [lvl["output_throughput_tok_s"] or math.nan for lvl in lvls], **style)
            ratio = [(lvl["output_throughput_tok_s"] or math.nan) / (base_tput.get(lvl["level"]) or math.nan)
                     for lvl in lvls]
            axes[0][2].plot(xs, ratio, **style)
            for ax, key in zip(axes[1], ("ttft_ms", "tpot_ms", "e2e_ms"), strict=True):
                for p, dash in (("p50", "-"), ("p99", "--")):
                    ax.plot(xs, [lvl[key][p] if lvl[key][p] is not None else math.nan for lvl in lvls], dash,
                            **style)
    ylabels = ("acceptance rate (0: nothing drafted)", "output throughput (tokens/s)",
               f"throughput / {base}'s",
               *(f"{name} (ms): P50 solid, P99 dashed" for name in ("TTFT", "TPOT", "e2e")))
    for ax, ylabel in zip([a for row in axes for a in row], ylabels, strict=True):
        ax.set_xlabel("temperature")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylim(0, 1.02)
    axes[0][2].axhline(1.0, color="grey", linewidth=0.8)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    out = _save(fig, path)
    plt.close(fig)
    return out


def plot_latencies(level: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Cumulative distributions of one level's per-request latencies (its `requests` records)."""
    plt = _pyplot()
    ok = [r for r in level["requests"] if r["ok"]]
    series = {"TTFT": [r["ttft"] for r in ok if r["ttft"] is not None],
              "TPOT": [r["tpot"] for r in ok if r["tpot"] is not None],
              "ITL": [x for r in ok for x in r["itl"]],
              "e2e": [r["e2e"] for r in ok if r["e2e"] is not None]}
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    for ax, (name, seconds) in zip(axes, series.items(), strict=True):
        ms = sorted(v * 1000 for v in seconds)
        if ms:
            ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], drawstyle="steps-post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("cumulative fraction")
    if title:
        fig.suptitle(title, fontsize=10)
    out = _save(fig, path)
    plt.close(fig)
    return out
