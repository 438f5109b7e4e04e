"""Run the offline benchmark once per mode (each in its own process) and summarise the results.

    python -m tools.benchmark.run_modes [--batch-sizes 1,8] [--max-tokens 128] [--update-readme]

Modes: baseline, ngram (k=4), suffix (k=8), draft_model (the target as its own draft, k=3) and mtp
(recorded as unavailable while the build has no MTP loader). Prompts: four copy-heavy and four chat
prompts from loadtests/data, interleaved (batch 1 uses the first, a copy prompt). Writes
results/spec_benchmark/<mode>-b<batch>.json, prompts.jsonl and summary.md; --update-readme puts the
summary into README.md between the spec_benchmark markers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tools.benchmark.summarize import rows, table

REPO = Path(__file__).resolve().parents[2]
README_START = "<!-- spec_benchmark:results:start -->"
README_END = "<!-- spec_benchmark:results:end -->"


def modes(model_folder: str) -> dict[str, dict | None]:
    return {
        "baseline": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 5},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8},
        "draft_model": {"method": "draft_model", "model": model_folder, "num_speculative_tokens": 3},
        "mtp": {"method": "mtp", "model": model_folder, "num_speculative_tokens": 1},
    }


def write_prompts(path: Path) -> None:
    from loadtests.workloads import chat_items, copy_items

    copy, chat = copy_items(), chat_items()
    lines = []
    for i in range(4):
        lines += [json.dumps({"messages": copy[i * 5].messages}), json.dumps({"messages": chat[i].messages})]
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.benchmark.run_modes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    p.add_argument("--output-dir", default="results/spec_benchmark")
    p.add_argument("--update-readme", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    write_prompts(prompts)
    folder = subprocess.run([sys.executable, "-c", "import engine\nfrom engine.models.loader import "
                             "default_model_folder\nprint(default_model_folder(progress=False))"],
                            capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    all_modes = modes(folder)
    names = args.modes.split(",") if args.modes else list(all_modes)
    files, unavailable = [], []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for name in names:
            path = out / f"{name}-b{batch}.json"
            cmd = [sys.executable, "-m", "tools.benchmark.spec_benchmark", "--label", name,
                   "--batch-size", str(batch), "--max-tokens", str(args.max_tokens), "--repeats",
                   str(args.repeats), "--warmup", str(args.warmup), "--prompt-file", str(prompts),
                   "--output-json", str(path)]
            if all_modes[name] is not None:
                cmd += ["--speculative-config", json.dumps(all_modes[name])]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                err = (proc.stderr.strip().splitlines() or ["failed"])[-1]
                print(f"{name} (batch {batch}): not available: {err}", flush=True)
                unavailable.append(f"{name}: {err}")
                continue
            print(proc.stdout.strip().splitlines()[0], flush=True)
            files.append(path)
    docs = [json.loads(f.read_text()) for f in files]
    md = table(rows(docs), markdown=True) + "\n"
    if unavailable:
        md += "\n" + "\n".join(f"- not measured: {u}" for u in sorted(set(unavailable))) + "\n"
    (out / "summary.md").write_text(md)
    print(md)
    if args.update_readme:
        readme = REPO / "README.md"
        text = readme.read_text()
        if README_START in text and README_END in text:
            head, rest = text.split(README_START, 1)
            readme.write_text(f"{head}{README_START}\n{md}{README_END}{rest.split(README_END, 1)[1]}")
    return 1 if any(r["same_ids"] is False for r in rows(docs)) else 0


if __name__ == "__main__":
    sys.exit(main())
