"""`specserve bench offline`: speculative modes A/B through the engine, in one process, no HTTP.

The target is loaded once. Every run gets a fresh engine over those weights with its mode's speculative
config, so no proposer state (suffix's response cache) leaks from one run into the next. A run
generates the whole prompt set: `--num-prompts` requests (cycling through the dataset) submitted at
once, at most `--max-num-seqs` in flight (1: one stream, one request after the other). After
`--num-warmups` unmeasured runs per mode come `--repeats` rounds, each running every mode once in
alternating order, so drift in the machine's speed hits every mode alike. `--temperature 0,0.7,1` runs
the whole comparison at each temperature in turn (sampled requests share `--seed`). `--assistant-model
A` (the speculative-decoding guide's form, with `--batch-size N`: N requests at once) adds mode
`assistant`: `mtp` when A is an MTP assistant, `draft_model` otherwise, K = `--num-speculative-tokens`.
`--precisions
float32,bfloat16,q8,auto` loads the target once per weight precision and runs every (precision, mode)
pair in the same interleaved rounds; each precision's modes are compared with its own `off`, and every
run with float32's `off`; a second table gives each precision's top-1 agreement with float32 and its
perplexity on held-out text (loadtests/quality.py).

With `--output-dir`, one JSON per mode in the format loadtests/data/spec_benchmark.schema.json describes
(config, model paths and revisions, package versions, environment variables, BLAS, the prompts and their
token ids, every generated token id, times, acceptance per draft position), plus summary.md. Printed:
tokens/s against `off` (pooled and per round), acceptance, and whether greedy token ids equal off's;
the exit status is 1 when they do not.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from loadtests import modes as modes_mod
from loadtests.datasets import WorkItem, load_dataset
from loadtests.prom import SpecCounters, acceptance_summary, merge_spec
from loadtests.quality import (
    engine_args,
    held_out_ids,
    load_args,
    precision_list,
    quality,
    quality_table,
    split_precision,
)
from loadtests.report import dumps, package_versions, slug

SCHEMA_VERSION = 1
_ENV_PREFIXES = ("SPECSERVE_", "MLX_", "OMP_", "MKL_", "OPENBLAS_", "VECLIB_", "KMP_", "HF_", "TOKENIZERS_")
_ENV_NAMES = ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES")
_PACKAGES = ("specserve", "mlx", "mlx-cpu", "mlx-metal", "mlx-lm", "numpy", "transformers", "tokenizers",
             "safetensors", "mkl")


def assistant_config(args: argparse.Namespace) -> dict[str, Any]:
    """The speculative config of --assistant-model: `mtp` for an MTP assistant (it names itself in its
    config's model_type), `draft_model` for any other model."""
    from engine.models.loader import resolve_source
    from engine.models.mtp_assistant import MTP_MODEL_TYPES

    path = resolve_source(args.assistant_model, args.assistant_revision)[1]
    model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    method = "mtp" if model_type in MTP_MODEL_TYPES else "draft_model"
    cfg: dict[str, Any] = {"method": method, "model": args.assistant_model,
                           "num_speculative_tokens": args.num_speculative_tokens}
    if args.assistant_revision:
        cfg["revision"] = args.assistant_revision
    return cfg


def run_batch(llm: Any, batch: list[list[int]], params: Any, tag: str) -> dict[str, Any]:
    """Generate the whole batch (one `SamplingParams`, or one per prompt) with our own step loop,
    counting acceptance per draft position from the engine's stats."""
    core = llm.core
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    plist = params if isinstance(params, list) else [params] * len(batch)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    ttft: dict[str, float | None] = dict.fromkeys(ids)
    e2e: dict[str, float | None] = dict.fromkeys(ids)
    finish: dict[str, str | None] = dict.fromkeys(ids)
    counts = SpecCounters()
    t0 = time.perf_counter()
    for rid, prompt, p in zip(ids, batch, plist, strict=True):
        core.add_request(rid, prompt, p)
    while core.has_unfinished():
        outputs, stats = core.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and ttft[out.request_id] is None:
                ttft[out.request_id] = now - t0
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
                e2e[out.request_id] = now - t0
        spec = stats.spec if stats is not None else None
        if spec is not None:
            counts.drafts += spec.num_drafts
            counts.draft_tokens += spec.num_draft_tokens
            counts.accepted += spec.num_accepted_tokens
            for i, n in enumerate(spec.accepted_per_pos):
                counts.per_pos[i] = counts.per_pos.get(i, 0) + n
    elapsed = time.perf_counter() - t0
    n_out = sum(len(t) for t in tokens.values())
    # Decoding alone, per request (vLLM's TPOT, inverted): tokens after each request's first over the time
    # from its first token to its last, so prefill and queueing are left out. Single stream: the decode rate.
    timed = [(len(tokens[r]) - 1, e2e[r] - ttft[r]) for r in ids  # type: ignore[operator]
             if ttft[r] is not None and e2e[r] is not None and len(tokens[r]) > 1]
    decode_s = sum(t for _, t in timed)
    return {"elapsed_s": elapsed, "output_tokens": n_out,
            "output_tokens_per_s": n_out / elapsed if elapsed > 0 else None,
            "decode_tokens_per_s": sum(n for n, _ in timed) / decode_s if decode_s > 0 else None,
            "ttft_s": [ttft[r] for r in ids], "e2e_s": [e2e[r] for r in ids],
            "finish_reasons": [finish[r] for r in ids],
            "token_ids": [tokens[r] for r in ids],
            "spec": acceptance_summary(counts) if core.spec is not None else None}


def _stats(values: list[float]) -> dict[str, float | None]:
    return {"mean": statistics.fmean(values) if values else None,
            "median": statistics.median(values) if values else None,
            "min": min(values) if values else None, "max": max(values) if values else None,
            "stdev": statistics.stdev(values) if len(values) > 1 else None}


def environment_variables() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}


def _model_info(loaded: Any) -> dict[str, Any]:
    return {"name": loaded.name, "path": str(loaded.path), "source": loaded.source,
            "dtype": str(loaded.dtype).removeprefix("mlx.core."), "revision": loaded.revision}


def prompt_records(items: list[WorkItem], tokenizer: Any, chat_template: bool) -> list[dict[str, Any]]:
    """The schema's prompt entries: the text or messages (none for token-id prompts) and the token ids."""
    from engine.llm import chat_prompt_ids

    out = []
    for it in items:
        if it.prompt_ids is not None:
            rec: dict[str, Any] = {"token_ids": list(it.prompt_ids)}
        elif chat_template:
            rec = {"messages": it.messages, "token_ids": chat_prompt_ids(tokenizer, it.messages)}
        else:
            text = it.prompt_text()
            rec = {"text": text, "token_ids": list(tokenizer.encode(text, add_special_tokens=True))}
        rec["num_tokens"] = len(rec["token_ids"])
        out.append(rec)
    return out


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    import engine
    from engine.blas import blas_info
    from engine.llm import LLM
    from engine.models.loader import load_model
    from engine.sampling import SamplingParams

    if getattr(args, "batch_size", None) is not None:
        args.num_prompts = args.max_num_seqs = args.batch_size
    if args.num_prompts < 1 or args.repeats < 1 or args.num_warmups < 0 or args.max_tokens < 1:
        raise SystemExit("--num-prompts, --repeats and --max-tokens must be >= 1, --num-warmups >= 0")
    if getattr(args, "assistant_model", None):
        extra = "assistant=" + json.dumps(assistant_config(args))
        args.speculative_config = [*args.speculative_config, extra]
    temps = temperatures(args.temperature)
    default = [modes_mod.OFF] if args.speculative_config else modes_mod.available()
    try:
        chosen = modes_mod.from_flags(args.modes, args.k, args.speculative_config, default)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    items = load_dataset(args.dataset_name, args.data)
    t_load = time.perf_counter()
    precisions: list[str | None] = precision_list(args.precisions) if args.precisions else [None]
    targets = {p: load_model(args.model, progress=False, revision=getattr(args, "revision", None),
                             **(load_args(p) if p else {"dtype": args.dtype}))  # type: ignore[arg-type]
               for p in precisions}
    loaded = targets[precisions[0]]
    load_s = time.perf_counter() - t_load
    qualities = _qualities(args, targets) if args.precisions else {}
    # (precision, mode) per label; one precision keeps the plain mode labels
    pairs = {(f"{p} {m}" if p else m): (p, m) for p in precisions for m in chosen}
    n = args.num_prompts
    used = items[:n]
    prompts = prompt_records(used, loaded.tokenizer, not args.skip_chat_template)
    batch = [prompts[i % len(prompts)]["token_ids"] for i in range(n)]
    kw: dict[str, Any] = dict(max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              max_num_seqs=args.max_num_seqs, show_progress=False)
    blas = blas_info()
    runtime = {"python": sys.version.split()[0], "platform": platform.platform(),
               "machine": platform.machine(), "cpu_count": os.cpu_count(),
               "engine_version": engine.__version__, "packages": package_versions(_PACKAGES),
               "device": str(mx.default_device()),
               "blas": {"name": blas.name, "path": blas.path, "reason": blas.reason}}
    common = {"args": args, "runtime": runtime, "prompts": prompts, "load_s": load_s,
              "batch_size": min(n, args.max_num_seqs)}
    all_docs: dict[str, dict[str, Any]] = {}
    all_rows: list[dict[str, Any]] = []
    for temp in temps:
        params = [SamplingParams(max_tokens=used[i % len(used)].max_tokens or args.max_tokens,
                                 temperature=temp, ignore_eos=args.ignore_eos,
                                 seed=args.seed if temp > 0 else None) for i in range(n)]

        def measure(label: str, tag: str, params: list[Any] = params) -> tuple[dict[str, Any], Any]:
            prec, mode = pairs[label]
            llm = LLM(loaded=targets[prec], speculative_config=chosen[mode], **kw, **engine_args(prec))
            return run_batch(llm, batch, params, tag), llm.core.spec

        where = f" t={temp:g}" if len(temps) > 1 else ""
        warm: dict[str, list[dict[str, Any]]] = {label: [] for label in pairs}
        for label in pairs:
            for i in range(args.num_warmups):
                warm[label].append(measure(label, f"w{i}")[0])
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in pairs}
        parsed: dict[str, Any] = {}
        for rep in range(args.repeats):
            order = list(pairs) if rep % 2 == 0 else list(pairs)[::-1]
            for label in order:
                res, parsed[label] = measure(label, f"r{rep}")
                runs[label].append({"repeat": rep, **res})
                acc = f", acceptance {res['spec']['acceptance_rate'] or 0:.2f}" if res["spec"] else ""
                print(f"[round {rep}{where}] {label:>18}: {res['output_tokens_per_s'] or 0:7.1f} tok/s{acc}",
                      flush=True)
        docs = {label: document(label, parsed[label], runs[label], warm[label], temperature=temp,
                                loaded=targets[pairs[label][0]], precision=pairs[label][0],
                                quality=qualities.get(pairs[label][0]), **common)
                for label in pairs}
        rows: list[dict[str, Any]] = []
        for prec in precisions:
            rows += summary_rows({k: d for k, d in docs.items() if pairs[k][0] == prec})
        ref_label = next((k for k, (p, m) in pairs.items() if p == "float32" and chosen[m] is None), None)
        if ref_label is not None:
            ref = docs[ref_label]["summary"]
            ref_tps = ref["output_tokens_per_s"]["mean"]
            ref_decode = (ref.get("decode_tokens_per_s") or {}).get("mean")
            for row in rows:
                row["vs_float32"] = row["tok_s"] / ref_tps if ref_tps and row["tok_s"] else None
                row["decode_vs_float32"] = (row["decode_tok_s"] / ref_decode
                                            if ref_decode and row["decode_tok_s"] else None)
        all_rows += [{**row, "temperature": temp} for row in rows]
        all_docs.update({f"{label}{where}": doc for label, doc in docs.items()})
    table = summary_table(all_rows, with_temperature=len(temps) > 1)
    if qualities:
        table += "\n\n" + quality_table({p: (targets[p].precision, q) for p, q in qualities.items()})
    print("\n" + table)
    if args.output_dir:
        write(all_docs, table, Path(args.output_dir), digest=args.digest_token_ids)
    return 1 if any(r["same_ids"] is False for r in all_rows) else 0


def _qualities(args: argparse.Namespace, targets: dict[Any, Any]) -> dict[str, dict[str, Any]]:
    """Each precision's agreement with float32 on held-out text (float32 loaded for it if not listed)."""
    from engine.models.loader import load_model

    ref = targets.get("float32") or load_model(args.model, dtype="float32", progress=False)
    texts = held_out_ids(ref.tokenizer)
    return {p: quality(t, ref, texts, split_precision(p)[1]) for p, t in targets.items()}


def temperatures(text: str | float) -> list[float]:
    """`--temperature`: one value or a comma-separated list, each >= 0."""
    try:
        temps = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--temperature: expected numbers separated by commas, got {text!r}") from None
    if not temps or any(t < 0 for t in temps):
        raise SystemExit(f"--temperature: expected values >= 0, got {text!r}")
    return temps


def document(label: str, spec: Any, runs: list[dict[str, Any]], warm: list[dict[str, Any]], *,
             temperature: float, args: argparse.Namespace, loaded: Any, runtime: dict[str, Any],
             prompts: list[dict[str, Any]], load_s: float, batch_size: int, precision: str | None = None,
             quality: dict[str, Any] | None = None) -> dict[str, Any]:
    """One mode's result in the spec_benchmark schema."""
    parsed = spec.model_dump() if spec is not None else None
    draft = None
    if spec is not None and getattr(spec, "model", None):
        path = Path(spec.model).expanduser()
        draft = {"path": str(path), "revision": spec.revision,
                 "same_as_target": path.resolve() == Path(loaded.path).resolve()}
    measured = [r["spec"] for r in runs if r["spec"] is not None]
    return {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "specserve.spec_benchmark",
        "label": label,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": list(sys.argv),
        "config": {
            "model": args.model, "speculative_config": parsed, "method": parsed["method"] if parsed else None,
            "num_speculative_tokens": parsed["num_speculative_tokens"] if parsed else 0,
            "batch_size": batch_size, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "warmup": args.num_warmups, "ignore_eos": args.ignore_eos, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_memory": args.kv_cache_memory,
            "dtype": args.dtype, "temperature": temperature, "seed": args.seed,
            "chat_template": not args.skip_chat_template, "precision": precision,
        },
        "models": {"target": {**_model_info(loaded), "precision": loaded.precision, "quality": quality},
                   "draft": draft},
        "runtime": runtime,
        "environment": environment_variables(),
        "prompts": prompts,
        "load_s": load_s,
        "warmup_runs": [{"elapsed_s": w["elapsed_s"], "output_tokens": w["output_tokens"]} for w in warm],
        "runs": runs,
        "summary": {
            "elapsed_s": _stats([r["elapsed_s"] for r in runs]),
            "output_tokens_per_s": _stats([r["output_tokens_per_s"] for r in runs
                                           if r["output_tokens_per_s"]]),
            "decode_tokens_per_s": _stats([r["decode_tokens_per_s"] for r in runs
                                           if r.get("decode_tokens_per_s")]),
            "output_tokens": runs[0]["output_tokens"] if runs else 0,
            "identical_across_repeats": all(r["token_ids"] == runs[0]["token_ids"] for r in runs),
            "spec": merge_spec(measured) if measured else None,
        },
    }


def summary_rows(docs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: tokens/s against the mode without speculation (pooled and round by round), acceptance,
    and, for greedy runs, whether every run's token ids equal its first run's."""
    base = next((d for d in docs.values() if d["config"]["speculative_config"] is None), None)
    greedy = base is not None and base["config"]["temperature"] == 0
    rows = []
    for label, d in docs.items():
        tps = d["summary"]["output_tokens_per_s"]
        spec = d["summary"]["spec"] or {}
        per_round = []
        if base is not None and d is not base:
            by_rep = {r["repeat"]: r["output_tokens_per_s"] for r in base["runs"]}
            per_round = [r["output_tokens_per_s"] / by_rep[r["repeat"]] if by_rep.get(r["repeat"]) else None
                         for r in d["runs"]]
        base_tps = base["summary"]["output_tokens_per_s"]["mean"] if base else None
        rows.append({
            "label": label, "tok_s": tps["mean"], "min": tps["min"], "max": tps["max"],
            "decode_tok_s": (d["summary"].get("decode_tokens_per_s") or {}).get("mean"),
            "speedup": tps["mean"] / base_tps if base_tps and tps["mean"] and d is not base else None,
            "speedup_rounds": per_round,
            "acceptance": spec.get("acceptance_rate"), "length": spec.get("mean_acceptance_length"),
            "per_pos": spec.get("acceptance_rate_per_position") or [],
            "same_ids": all(r["token_ids"] == base["runs"][0]["token_ids"] for r in d["runs"])
            if greedy and base is not None else None,
        })
    return rows


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def summary_table(rows: list[dict[str, Any]], with_temperature: bool = False) -> str:
    """Markdown: one row per mode (and temperature)."""
    vs32 = any("vs_float32" in r for r in rows)
    head = ["mode", *(["temperature"] if with_temperature else []), "tok/s (min-max)", "decode tok/s",
            "x off", *(["x float32 off", "decode x float32 off"] if vs32 else []), "x off, per round",
            "acc. rate", "acc. len",
            "acceptance per position", "greedy ids = off"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"], *([f"{r['temperature']:g}"] if with_temperature else []),
                 f"{_f(r['tok_s'], '.1f')} ({_f(r['min'], '.1f')}-{_f(r['max'], '.1f')})",
                 _f(r.get("decode_tok_s"), ".1f"), _f(r["speedup"]),
                 *([_f(r.get("vs_float32")), _f(r.get("decode_vs_float32"))] if vs32 else []),
                 " ".join(_f(x) for x in r["speedup_rounds"]) or "-", _f(r["acceptance"]),
                 _f(r["length"]), " ".join(_f(p) for p in r["per_pos"]) or "-",
                 "-" if r["same_ids"] is None else ("yes" if r["same_ids"] else "NO")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def token_digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def digest_token_ids(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with each run's output token ids as digests (equal outputs, equal digests) and the prompts'
    token ids dropped where their text or messages say what was sent."""
    runs = [{k: v for k, v in r.items() if k != "token_ids"}
            | {"token_ids_sha256": [token_digest(t) for t in r["token_ids"]]} if "token_ids" in r else r
            for r in doc["runs"]]
    prompts = [{k: v for k, v in p.items() if k != "token_ids"} if ("text" in p or "messages" in p) else p
               for p in doc["prompts"]]
    return {**doc, "runs": runs, "prompts": prompts}


def write(docs: dict[str, dict[str, Any]], table: str, out: Path, digest: bool = False) -> None:
    from loadtests.schema import validate

    out.mkdir(parents=True, exist_ok=True)
    for label, doc in docs.items():
        doc = digest_token_ids(doc) if digest else doc
        errors = validate(doc)
        if errors:  # a bug here, not in the caller: fail loudly rather than write a bad file
            raise SystemExit(f"{label}: result does not match the schema: " + "; ".join(errors[:5]))
        (out / f"{slug(label)}.json").write_text(dumps(doc) + "\n")
    (out / "summary.md").write_text(table + "\n")
    print(f"wrote {len(docs)} results and summary.md to {out}")
