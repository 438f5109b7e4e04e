"""PNG plots: output throughput and P99 TPOT against load, one line per server on the same axes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _x(level: dict[str, Any]) -> float | None:
    return level.get("concurrency") if level.get("concurrency") is not None else level.get("qps")


def plot_runs(runs: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """`runs`: [{"label", "levels": [level summary, ...]}] for one workload."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_qps = any(lvl.get("concurrency") is None for run in runs for lvl in run["levels"])
    ticks = sorted({x for run in runs for lvl in run["levels"] if (x := _x(lvl)) is not None})
    for run in runs:
        pts = sorted((x, lvl) for lvl in run["levels"] if (x := _x(lvl)) is not None and lvl["completed"])
        if not pts:
            continue
        xs = [x for x, _ in pts]
        style = "--" if "mlx" in run["label"] else "-"  # other servers dashed, ours solid
        ax_tp.plot(xs, [lvl["output_throughput_tok_s"] for _, lvl in pts], style, marker="o",
                   label=run["label"])
        tpot = [lvl["tpot_s"]["p99"] * 1000 if lvl["tpot_s"]["p99"] is not None else float("nan")
                for _, lvl in pts]
        ax_tpot.plot(xs, tpot, style, marker="o", label=run["label"])
    xlabel = "request rate (QPS, Poisson)" if by_qps else "concurrency (requests in flight)"
    for ax, ylabel in ((ax_tp, "output throughput (tokens/s)"), (ax_tpot, "P99 TPOT (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if not by_qps:
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_tp.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_by_workload(runs: list[dict[str, Any]], out_dir: str | Path, prefix: str = "",
                     title: str = "") -> list[Path]:
    """One PNG per workload found in `runs`, named <prefix><workload>.png."""
    paths = []
    for wl in dict.fromkeys(run["workload"] for run in runs):
        sel = [run for run in runs if run["workload"] == wl]
        paths.append(plot_runs(sel, Path(out_dir) / f"{prefix}{wl}.png",
                               title=f"{title} workload: {wl}".strip()))
    return paths
