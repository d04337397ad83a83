"""The `penelope` command line. Each subcommand is a module of `penelope.commands` with
`add_parser(subparsers)` and `run(args) -> int`; those modules import heavy packages (torch)
only inside `run`, so `penelope cost` stays quick."""
from __future__ import annotations

import argparse
import importlib
import sys

from penelope.errors import UsageError

# Subcommand name -> module in penelope.commands, in the order `--help` lists them.
COMMANDS = ("reproduce", "cost", "simulate", "analyze", "verify")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="penelope",
        description="Position-aware KV-cache eviction for agentic LLM serving.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"penelope.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(f"penelope.commands.{args.command}")
    try:
        return int(module.run(args) or 0)
    except UsageError as err:
        print(f"penelope: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
