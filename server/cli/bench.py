"""`specserve bench`: the load tests' own command line (loadtests/cli.py), mounted as a subcommand."""

from __future__ import annotations

from loadtests.cli import add_parser, run

__all__ = ["add_parser", "run"]
