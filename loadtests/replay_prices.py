"""Replay recorded steps through the adaptive controller's cost model: what it would have priced a draft
at, step by step, on exactly the steps a server ran.

    python -m loadtests.replay_prices results/tmp/trace.jsonl [--rows 8] [--tree DIR]

Input: `specserve serve --step-trace FILE` traces. Every decode/verify step is fed to `StepCostModel`
(prefill-carrying steps interrupt the step pairs, as in the engine) and, after each step of the request
count asked for, the fitted (first, further) draft prices are read. Prints their 10th/50th/90th
percentiles per request count. `--tree DIR` imports the cost model from another source tree (a git
worktree of an older commit), so two cost models can be compared on the same steps. A replay does not
re-decide K: the drafts are those the server chose.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

from loadtests.traces import is_decode, load


def cost_module(tree: str | None) -> ModuleType:
    if tree is None:
        from engine.spec import cost_model
        return cost_model
    # The cost model has its own module since 2026-11-25; older trees kept it in adaptive.py.
    path = Path(tree) / "engine" / "spec" / "cost_model.py"
    if not path.exists():
        path = path.with_name("adaptive.py")
    spec = importlib.util.spec_from_file_location("replayed_cost_model", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def replay(records: list[dict], mod: ModuleType) -> dict[int, list[tuple[float, float]]]:
    """Request count -> the draft prices after each decode/verify step with that many requests."""
    model = mod.StepCostModel()
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    prev_k: list[int] = []
    for r in records:
        if not is_decode(r):
            if hasattr(model, "interrupt"):
                model.interrupt()
            prev_k = r.get("next_k") or []
            continue
        rows, drafts = r["requests"], r.get("drafts_verified", 0)
        # Traces before `requests_drafting` existed: the previous step's choices, capped by the drafts.
        drafting = r.get("requests_drafting", min(sum(1 for k in prev_k if k > 0), drafts))
        model.observe(r["tokens"], r["step_s"], rows, drafting)
        prices = model.draft_prices(rows)
        if prices is not None:
            out[rows].append(prices)
        prev_k = r.get("next_k") or []
    return out


def percentiles(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    return xs[len(xs) // 10], xs[len(xs) // 2], xs[(9 * len(xs)) // 10]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--rows", type=int, action="append", help="request counts to show (default: all)")
    ap.add_argument("--tree", default=None, help="source tree whose cost model (engine/spec/cost_model.py, "
                    "or adaptive.py before it) to replay")
    args = ap.parse_args(argv)
    mod = cost_module(args.tree)
    print("trace | requests | steps priced | first draft ms p10/p50/p90 | further draft ms p10/p50/p90")
    for path in args.traces:
        for rows, prices in sorted(replay(load(path), mod).items()):
            if args.rows and rows not in args.rows:
                continue
            first = percentiles([1000 * p[0] for p in prices])
            further = percentiles([1000 * p[1] for p in prices])
            print(f"{Path(path).name} | {rows} | {len(prices)} | " + "/".join(f"{x:.1f}" for x in first)
                  + " | " + "/".join(f"{x:.1f}" for x in further))
    return 0


if __name__ == "__main__":
    sys.exit(main())
