"""The ``moeify`` command. Each subcommand lives in its own module under moeify.cli with a
``register(subparsers)`` function that adds its parser and sets ``func``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Subcommand modules, in the order --help lists them.
COMMANDS = ["demo", "bench"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeify",
        description="Mixture-of-Experts everywhere inside a Transformer: build, train, evaluate, "
        "benchmark and inspect SwitchHead, MoA, sigma-MoE, Switch and Mixture-of-Depths models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"moeify.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from moeify.errors import MoeifyError

    try:
        return int(args.func(args) or 0)
    except (MoeifyError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        if os.environ.get("MOEIFY_DEBUG"):
            raise
        print(f"moeify {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moeify {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
