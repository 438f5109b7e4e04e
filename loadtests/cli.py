"""`specserve bench {serve,offline,sweep,structured,replicas,scale-sim,engine,kv-layout}`: benchmarks.

    # online load against any OpenAI-compatible server (specserve, vllm serve, mlx_lm.server, ...)
    specserve bench serve --base-url http://127.0.0.1:8000 --dataset-name copy --max-concurrency 8 \\
        --num-prompts 64 --save-result --plot
    # speculative modes through the engine in one process, interleaved, JSON per mode
    specserve bench offline --modes off,ngram,suffix --num-prompts 8 --output-dir results/tmp/offline
    # several servers on loopback, same load interleaved, B/A ratios
    specserve bench sweep --modes off,ngram --dataset-name copy,mixed-temp --max-concurrency 1,8,32
    # adaptive K against static K: auto must not lose to the best of the others
    specserve bench sweep --modes off,ngram,ngram-auto --k 1,2,4 --max-concurrency 1,8,16,32 --rounds 2
    # speculation on and off against temperature: acceptance, tokens/s, TTFT / TPOT per temperature
    specserve bench sweep --modes off,ngram --temperatures 0,0.4,0.8,1.0 --max-concurrency 8
    # an operator's mix (half extraction at 0.1, half creative at 1.0), P50 / P99 per class
    specserve bench sweep --modes off,ngram --dataset-name extraction-creative --max-concurrency 8
    # one engine against Ray Serve replicas, and against the model over 2 ranks; users x replicas
    # simulated from a step trace
    specserve bench replicas --rounds 3 --output-dir results/replicas
    specserve bench replicas --compare tensor-parallel --rounds 3 --output-dir results/tensor-parallel
    specserve bench scale-sim --trace STEPS.jsonl --users 10,100,1000

Modes are "off" and the example configs in configs/*.yaml, named after the file (see loadtests/modes.py).
The engine is imported only when a subcommand that runs it starts.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from loadtests import engine_bench, kv_layout, offline, replicas, scale_sim, serve, structured, sweep
from loadtests.client import CHAT, COMPLETIONS, RequestOptions
from loadtests.datasets import BUILT_IN, DATASETS, DatasetOptions

FORMATTER = argparse.RawDescriptionHelpFormatter


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add `bench` and its subcommands to a `specserve` subparsers object."""
    bench = sub.add_parser("bench", help="benchmarks: serve (online load), offline (engine A/B), sweep, "
                                         "structured, replicas, scale-sim, engine, kv-layout",
                           description=__doc__, formatter_class=FORMATTER)
    cmds = bench.add_subparsers(dest="bench_command", required=True,
                                metavar="{serve,offline,sweep,structured,replicas,scale-sim,engine,kv-layout}")

    p = cmds.add_parser("serve", help="online load against one OpenAI-compatible server",
                        description=serve.__doc__, formatter_class=FORMATTER)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    p.add_argument("--model", default=None, help="request 'model' (default: the first of /v1/models)")
    p.add_argument("--label", default=None, help="name of this run in the result (default: the model)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests in all (default: %(default)s)")
    p.add_argument("--duration", type=float, default=float("inf"),
                   help="seconds after which no new request starts (default: none)")
    _dataset_arguments(p, default="chat")
    _request_arguments(p)
    p.add_argument("--num-warmups", type=int, default=1,
                   help="unmeasured requests first (default: %(default)s)")
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument("--save-detailed", action="store_true", help="keep every request's timings in the JSON")
    p.add_argument("--result-dir", default=".", help="where --save-result and --plot write (default: .)")
    p.add_argument("--result-filename", default=None,
                   help="JSON file name (default: LABEL-DATASET-LEVEL-DATE.json)")
    p.add_argument("--plot", action="store_true", help="PNG of the latency distributions (needs matplotlib)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(bench_func=serve.run)

    p = cmds.add_parser("offline", help="speculative modes A/B through the engine in one process",
                        description=offline.__doc__, formatter_class=FORMATTER)
    _mode_arguments(p)
    p.add_argument("--model", default=None,
                   help="target: HF folder, GGUF or Hub id (default: the default model)")
    p.add_argument("--revision", default=None, help="the target's Hub revision (branch, tag or commit)")
    g = p.add_argument_group("the speculative-decoding guide's form (one more mode, 'assistant')")
    g.add_argument("--assistant-model", default=None, metavar="MODEL",
                   help="an MTP assistant (mtp) or a smaller model of the target's family (draft_model): "
                        "folder or Hub id; runs as mode 'assistant' beside off")
    g.add_argument("--assistant-revision", default=None, help="its Hub revision")
    g.add_argument("--num-speculative-tokens", type=int, default=1,
                   help="K for --assistant-model (default: %(default)s, as the guide runs Gemma4 assistants)")
    g.add_argument("--batch-size", type=int, default=None,
                   help="requests per run, all in flight at once (sets --num-prompts and --max-num-seqs)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--precisions", default=None, metavar="LIST",
                   help="comma-separated weight precisions to compare (auto, float32, bfloat16, float16, q8, "
                        "q4), each optionally with its activation precision (auto:int8, auto:float32): "
                        "every mode at each, interleaved, plus agreement with float32")
    p.add_argument("--num-prompts", type=int, default=8, help="requests per run (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most requests in flight (1: one stream; default: %(default)s, all at once)")
    _dataset_arguments(p, default="copy")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: %(default)s)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--temperature", default="0",
                   help="for every request; a comma-separated list runs every mode at each, one after the "
                        "other (default: 0, greedy: output must equal off's exactly)")
    p.add_argument("--skip-chat-template", action="store_true", help="tokenize prompts as plain text")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds (default: %(default)s)")
    p.add_argument("--num-warmups", type=int, default=1,
                   help="unmeasured runs per mode (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--output-dir", default=None, help="write one JSON per mode and summary.md here")
    p.add_argument("--digest-token-ids", action="store_true",
                   help="write each output's token ids as a sha256 digest and prompts without theirs "
                        "(results to commit: the same comparisons, a fraction of the bytes)")
    p.set_defaults(bench_func=offline.run)

    # Subcommands that bring their own arguments (`add_arguments`) and entry point (`run`).
    for name, module, help_ in (
            ("structured", structured, "structured outputs: mask cost, and ngram on JSON extraction"),
            ("replicas", replicas, "replicas on Ray Serve, or 2 tensor-parallel ranks, vs one engine"),
            ("scale-sim", scale_sim, "capacity planning: users x replicas, simulated from a step trace"),
            ("engine", engine_bench, "the engine against mlx-lm, per BLAS, in one run"),
            ("kv-layout", kv_layout, "KV layout or attention backend A/B through the engine")):
        p = cmds.add_parser(name, help=help_, description=module.__doc__, formatter_class=FORMATTER)
        module.add_arguments(p)
        p.set_defaults(bench_func=module.run)

    p = cmds.add_parser("sweep", help="several servers on loopback, same load interleaved, ratios",
                        description=sweep.__doc__, formatter_class=FORMATTER)
    _mode_arguments(p)
    p.add_argument("--server", action="append", default=[], metavar="LABEL=COMMAND|URL",
                   help="another server: a command line to start ({port} optional; may begin with VAR=value "
                        "assignments) or the URL of a running one (repeatable)")
    p.add_argument("--mlx-lm", action="store_true",
                   help="add mlx_lm.server (side venv .venv-mlxlm, float32 copy of the default model)")
    p.add_argument("--serve-args", default=None, help="extra flags for every `specserve serve` started")
    p.add_argument("--step-traces", action="store_true",
                   help="each specserve server writes OUTPUT/logs/<label>.steps.jsonl (--step-trace)")
    p.add_argument("--base", default=None,
                   help="server the ratios divide by (default: off where it runs, else the first)")
    p.add_argument("--request-rate", default="inf", help="comma-separated rates (default: inf)")
    p.add_argument("--max-concurrency", default=None,
                   help="comma-separated levels (default: 1,8,16,32; with a finite rate: no limit)")
    p.add_argument("--temperatures", default=None,
                   help="comma-separated: every level once per temperature, every request at it, each "
                        "prompt with a fixed seed (default: each dataset's own; with it, the datasets "
                        "default to copy,chat)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default: --prompts-per-slot x concurrency, at least 4; with a "
                        "finite rate: rate x --duration)")
    p.add_argument("--prompts-per-slot", type=int, default=1,
                   help="requests each slot sends per level (default 1: one wave; more: sustained load)")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds per level and round after which no request starts (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="measure each level this many times, interleaved")
    p.add_argument("--num-warmups", type=int, default=2, help="unmeasured requests per server and dataset")
    _dataset_arguments(p, default="copy,mixed-temp", several=True)
    _request_arguments(p)
    p.add_argument("--output-dir", default="results/tmp/bench-sweep")
    p.add_argument("--save-detailed", action="store_true", help="keep every request's timings in sweep.json")
    p.add_argument("--render", metavar="SWEEP_JSON", default=None,
                   help="measure nothing: rebuild results.md and the plots from a sweep.json")
    p.set_defaults(bench_func=sweep.run)
    return bench


def _mode_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("modes (off, and one per configs/*.yaml)")
    g.add_argument("--modes", default=None, help="comma-separated, e.g. off,ngram,suffix (default: all)")
    g.add_argument("--k", default=None, help="comma-separated K: each static-K mode once per K ('ngram k=2')")
    g.add_argument("--speculative-config", action="append", default=[], metavar="LABEL=JSON",
                   help="one more mode from a JSON speculative config (repeatable)")


def _dataset_arguments(p: argparse.ArgumentParser, default: str, several: bool = False) -> None:
    g = p.add_argument_group("dataset")
    # The default is filled in later: --dataset-path alone means the custom dataset.
    g.add_argument("--dataset-name", default=None,
                   help=f"{'comma-separated, ' if several else ''}one of {', '.join(DATASETS)} "
                        f"(default: {default}; built-in: {', '.join(BUILT_IN)})")
    g.add_argument("--dataset-path", default=None, help="JSONL of chats for 'custom' (implies it)")
    p.set_defaults(dataset_default=default)
    g.add_argument("--random-input-len", type=int, default=256, help="random: prompt tokens")
    g.add_argument("--random-output-len", type=int, default=64, help="random: tokens asked for")
    g.add_argument("--random-vocab-size", type=int, default=32000, help="random: token ids drawn below this")
    g.add_argument("--greedy-fraction", type=float, default=0.5, help="mixed-temp: share of greedy requests")
    g.add_argument("--seed", type=int, default=0)


def _request_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests")
    g.add_argument("--endpoint", choices=[CHAT, COMPLETIONS], default=None,
                   help=f"default: {CHAT} ({COMPLETIONS} for random)")
    g.add_argument("--max-tokens", type=int, default=64, help="per request, where the dataset sets none")
    g.add_argument("--temperature", type=float, default=None,
                   help="for every request (default: the dataset's own)")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM / specserve extension)")
    g.add_argument("--extra-body", default=None, help="JSON merged into every request body")


def dataset_options(args: argparse.Namespace) -> DatasetOptions:
    return DatasetOptions(dataset_path=args.dataset_path, num_prompts=args.num_prompts or 100,
                          random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                          random_vocab_size=args.random_vocab_size, greedy_fraction=args.greedy_fraction,
                          seed=args.seed)


def request_options(args: argparse.Namespace) -> RequestOptions:
    names = args.dataset_name.split(",")
    endpoint = args.endpoint or (COMPLETIONS if "random" in names else CHAT)
    return RequestOptions(endpoint=endpoint, model=getattr(args, "model", None), max_tokens=args.max_tokens,
                          temperature=args.temperature, ignore_eos=args.ignore_eos,
                          api_key=os.environ.get("OPENAI_API_KEY") or None,
                          extra_body=json.loads(args.extra_body) if args.extra_body else {})


def run(args: argparse.Namespace) -> int:
    """Run the `bench` subcommand `args` were parsed for."""
    if not hasattr(args, "dataset_name"):  # `structured` brings its own prompts
        return int(args.bench_func(args) or 0)
    if args.dataset_name is None:
        # A temperature sweep replaces the datasets' temperatures: its default leaves them to the run.
        default = "copy,chat" if getattr(args, "temperatures", None) else args.dataset_default
        args.dataset_name = "custom" if args.dataset_path else default
    args.data = dataset_options(args)
    if hasattr(args, "endpoint"):
        args.request = request_options(args)
    return int(args.bench_func(args) or 0)
