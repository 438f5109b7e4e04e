"""PNG plots (matplotlib, a dev dependency: imported only when a plot is asked for).

- `plot_runs`: output throughput and P99 TPOT against load, one line per server (`bench sweep`).
- `plot_latencies`: the distribution of TTFT, TPOT, ITL and e2e latency of one run (`bench serve`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
                    title: str = "") -> list[Path]:
    """One PNG per dataset found in `runs`, named <prefix><dataset>.png."""
    paths = []
    for ds in dict.fromkeys(run["dataset"] for run in runs):
        sel = [run for run in runs if run["dataset"] == ds]
        paths.append(plot_runs(sel, Path(out_dir) / f"{prefix}{ds}.png",
                               title=f"{title} dataset: {ds}".strip()))
    return paths


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
