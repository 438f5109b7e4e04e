"""The `specserve` command: `main()` parses the command line and runs one subcommand, each in its own
module (serve, prepare, train, bench)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

from engine import platform
from server.cli import bench, prepare, serve, train

# Every subcommand but serve, which also takes the command line (its tensor-parallel ranks rerun it).
_RUN: dict[str, Callable[[argparse.Namespace], int]] = {
    "prepare": prepare.run, "train-assistant": train.run_assistant, "train-eagle3": train.run_eagle3,
    "train-draft": train.run_draft, "bench": bench.run}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="OpenAI-compatible LLM server on MLX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{serve,prepare,train-assistant,train-eagle3,train-draft,bench}")
    serve.add_parser(sub)
    prepare.add_parser(sub)
    train.add_parsers(sub)
    bench.add_parser(sub)
    return parser


def _version() -> str:
    try:
        return version("specserve")
    except PackageNotFoundError:  # a checkout run with `python -m server.cli`, never installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        platform.setup()  # before anything imports mlx
    except (ValueError, RuntimeError) as e:  # a bad SPECSERVE_* value
        print(f"specserve: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve.run(args, list(argv) if argv is not None else sys.argv[1:])
    return _RUN[args.command](args)
