"""Offline speculative-decoding benchmark: one mode per process, everything needed to reproduce it.

    python -m tools.benchmark.spec_benchmark --label baseline --output-json base.json
    python -m tools.benchmark.spec_benchmark --label ngram --output-json ngram.json \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}'

One engine per process (no state shared between modes); `--warmup` unmeasured runs, then `--repeats`
measured runs of the whole batch (`--batch-size` sequences generated together, cycling through the
prompts). The JSON (schema: spec_benchmark.schema.json) records the config, model paths and revisions,
package versions, relevant environment variables, the BLAS/backend, the prompts and their token ids,
every generated token id, elapsed time, output tokens/s and acceptance counts per draft position.
Run modes in separate processes and compare their JSON files: greedy token ids must be identical.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("spec_benchmark.schema.json")
_ENV_PREFIXES = ("SPECSERVE_", "MLX_", "OMP_", "MKL_", "OPENBLAS_", "VECLIB_", "KMP_", "HF_", "TOKENIZERS_")
_ENV_NAMES = ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES")
_PACKAGES = ("specserve", "mlx", "mlx-cpu", "mlx-metal", "mlx-lm", "numpy", "transformers", "tokenizers",
             "safetensors", "mkl")
# A copy-heavy default: speculation has something to find, so acceptance per position is informative.
DEFAULT_PROMPT = ("Repeat the following text exactly, word for word.\n\nThe quick brown fox jumps over "
                  "the lazy dog near the river bank. A small bird sings on the old oak tree while the "
                  "farmer walks to the market with a basket of red apples and a loaf of fresh bread. In the "
                  "afternoon the children play football in the field behind the school, and their parents "
                  "watch from the benches.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.benchmark.spec_benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder, GGUF or Hub id (default: the default model)")
    p.add_argument("--speculative-config", default=None,
                   help="JSON object (or a path to a .json file); omitted: no speculation (baseline)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences generated together (default: 1)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="measured runs (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs first (default: 1)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, exact verification")
    p.add_argument("--seed", type=int, default=0,
                   help="per-request sampling seed (matters when temperature > 0)")
    p.add_argument("--label", default=None,
                   help="name of this mode in the JSON (default: the method, or 'baseline')")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--prompt-file", default=None,
                   help=".jsonl with {'prompt': str} or {'messages': [...]} per line; any other file is "
                        "one prompt")
    p.add_argument("--raw-prompt", action="store_true",
                   help="tokenize prompts as plain text, no chat template")
    p.add_argument("--output-json", default=None,
                   help="where to write the result (default: print a summary only)")
    return p


def load_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """-> [{"text": str} | {"messages": [...]}]."""
    prompts: list[dict[str, Any]] = [{"text": t} for t in args.prompt or []]
    if args.prompt_file:
        path = Path(args.prompt_file)
        if path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    prompts.append({"messages": rec["messages"]} if "messages" in rec
                                   else {"text": rec["prompt"]})
        else:
            prompts.append({"text": path.read_text()})
    return prompts or [{"text": DEFAULT_PROMPT}]


def parse_spec(value: str | None) -> dict[str, Any] | None:
    if not value:
        return None
    path = Path(value)
    text = path.read_text() if not value.lstrip().startswith("{") and path.is_file() else value
    return json.loads(text)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in _PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def environment_variables() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}


def spec_summary(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> dict[str, Any]:
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "accepted_per_position": per_pos,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate_per_position": [n / drafts if drafts else None for n in per_pos]}


def run_batch(llm: Any, batch: list[list[int]], params: Any, tag: str) -> dict[str, Any]:
    """Generate the whole batch with our own step loop, collecting per-position acceptance."""
    core = llm.core
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    ttft: dict[str, float | None] = dict.fromkeys(ids)
    finish: dict[str, str | None] = dict.fromkeys(ids)
    drafts = draft_tokens = accepted = 0
    per_pos: list[int] = []
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, batch, strict=True):
        core.add_request(rid, prompt, params)
    while core.has_unfinished():
        outputs, stats = core.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and ttft[out.request_id] is None:
                ttft[out.request_id] = now - t0
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        spec = stats.spec if stats is not None else None
        if spec is not None:
            drafts += spec.num_drafts
            draft_tokens += spec.num_draft_tokens
            accepted += spec.num_accepted_tokens
            per_pos.extend([0] * (len(spec.accepted_per_pos) - len(per_pos)))
            for i, n in enumerate(spec.accepted_per_pos):
                per_pos[i] += n
    elapsed = time.perf_counter() - t0
    n_out = sum(len(t) for t in tokens.values())
    return {"elapsed_s": elapsed, "output_tokens": n_out,
            "output_tokens_per_s": n_out / elapsed if elapsed > 0 else None,
            "ttft_s": [ttft[r] for r in ids], "finish_reasons": [finish[r] for r in ids],
            "token_ids": [tokens[r] for r in ids],
            "spec": spec_summary(drafts, draft_tokens, accepted, per_pos) if core.spec is not None else None}


def _stats(values: list[float]) -> dict[str, float | None]:
    return {"mean": statistics.fmean(values) if values else None,
            "median": statistics.median(values) if values else None,
            "min": min(values) if values else None, "max": max(values) if values else None,
            "stdev": statistics.stdev(values) if len(values) > 1 else None}


def _model_info(loaded: Any) -> dict[str, Any]:
    return {"name": loaded.name, "path": str(loaded.path), "source": loaded.source,
            "dtype": str(loaded.dtype).removeprefix("mlx.core."), "revision": loaded.revision}


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import engine  # noqa: I001 - selects the BLAS before mlx is imported, so it must come first
    import mlx.core as mx
    from engine.blas import blas_info
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    spec_cfg = parse_spec(args.speculative_config)
    t_load = time.perf_counter()
    llm = LLM(model=args.model, speculative_config=spec_cfg, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
              dtype=args.dtype, max_num_seqs=max(64, args.batch_size), show_progress=False)
    load_s = time.perf_counter() - t_load
    prompts = load_prompts(args)
    for p in prompts:
        if args.raw_prompt and "text" in p:
            p["token_ids"] = llm.encode(p["text"])
        else:
            msgs = p.get("messages") or [{"role": "user", "content": p["text"]}]
            p["token_ids"] = llm.apply_chat_template(msgs)
        p["num_tokens"] = len(p["token_ids"])
    batch = [prompts[i % len(prompts)]["token_ids"] for i in range(args.batch_size)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            ignore_eos=args.ignore_eos, seed=args.seed if args.temperature > 0 else None)
    warm = [run_batch(llm, batch, params, f"w{i}") for i in range(args.warmup)]
    runs = [{"repeat": i, **run_batch(llm, batch, params, f"r{i}")} for i in range(args.repeats)]

    spec = llm.core.spec
    parsed = spec.model_dump() if spec is not None else None
    draft = None
    if spec is not None and getattr(spec, "model", None):
        path = Path(spec.model).expanduser()
        draft = {"path": str(path), "revision": spec.revision,
                 "same_as_target": path.resolve() == Path(llm.core.loaded.path).resolve()}
    measured = [r["spec"] for r in runs if r["spec"] is not None]
    pooled = None
    if measured:
        width = max(len(s["accepted_per_position"]) for s in measured)
        pooled = spec_summary(sum(s["num_drafts"] for s in measured),
                              sum(s["num_draft_tokens"] for s in measured),
                              sum(s["num_accepted_tokens"] for s in measured),
                              [sum(s["accepted_per_position"][i] for s in measured
                                   if i < len(s["accepted_per_position"])) for i in range(width)])
    blas = blas_info()
    return {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "specserve.spec_benchmark",
        "label": args.label or (parsed["method"] if parsed else "baseline"),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": [sys.executable, "-m", "tools.benchmark.spec_benchmark", *sys.argv[1:]],
        "config": {
            "model": args.model, "speculative_config": parsed,
            "method": parsed["method"] if parsed else None,
            "num_speculative_tokens": parsed["num_speculative_tokens"] if parsed else 0,
            "batch_size": args.batch_size, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "warmup": args.warmup, "ignore_eos": args.ignore_eos, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_memory": args.kv_cache_memory,
            "dtype": args.dtype, "temperature": args.temperature, "seed": args.seed,
            "chat_template": not args.raw_prompt,
        },
        "models": {"target": _model_info(llm.core.loaded), "draft": draft},
        "runtime": {
            "python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "engine_version": engine.__version__, "packages": _versions(),
            "device": str(mx.default_device()), "blas": {"name": blas.name, "path": blas.path,
                                                          "reason": blas.reason},
        },
        "environment": environment_variables(),
        "prompts": prompts,
        "load_s": load_s,
        "warmup_runs": [{"elapsed_s": w["elapsed_s"], "output_tokens": w["output_tokens"]} for w in warm],
        "runs": runs,
        "summary": {
            "elapsed_s": _stats([r["elapsed_s"] for r in runs]),
            "output_tokens_per_s": _stats([r["output_tokens_per_s"] for r in runs
                                           if r["output_tokens_per_s"]]),
            "output_tokens": runs[0]["output_tokens"] if runs else 0,
            "identical_across_repeats": all(r["token_ids"] == runs[0]["token_ids"] for r in runs),
            "spec": pooled,
        },
    }


def print_summary(doc: dict[str, Any]) -> None:
    s = doc["summary"]
    tps = s["output_tokens_per_s"]
    line = (f"{doc['label']}: batch {doc['config']['batch_size']}, {s['output_tokens']} tokens/run, "
            f"{tps['mean'] or 0:.1f} tok/s mean ({tps['min'] or 0:.1f}-{tps['max'] or 0:.1f}) over "
            f"{doc['config']['repeats']} runs")
    spec = s["spec"]
    if spec:
        rates = ", ".join(f"{r:.2f}" for r in spec["acceptance_rate_per_position"] if r is not None)
        line += (f"; acceptance {spec['acceptance_rate'] or 0:.2f}, mean length "
                 f"{spec['mean_acceptance_length'] or 0:.2f}, per position [{rates}]")
    print(line)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1 or args.repeats < 1 or args.warmup < 0 or args.max_tokens < 1:
        raise SystemExit("--batch-size, --repeats and --max-tokens must be >= 1, --warmup >= 0")
    doc = benchmark(args)
    print_summary(doc)
    if args.output_json:
        from tools.benchmark.schema import validate

        errors = validate(doc)
        if errors:  # a bug here, not in the caller: fail loudly rather than write a bad file
            raise SystemExit("result does not match the schema: " + "; ".join(errors[:5]))
        out = Path(args.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
