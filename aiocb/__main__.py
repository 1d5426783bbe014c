"""The ``aiocb`` command (also ``python -m aiocb``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from aiocb.cli.demo import add_demo_arguments, run_demo
from aiocb.cli.serve import add_serve_arguments, run_serve


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand."""
    parser = argparse.ArgumentParser(prog="aiocb", description="asyncio-native continuous batching")
    commands = parser.add_subparsers(dest="command", required=True)
    add_demo_arguments(commands.add_parser("demo", help="stream concurrent generations from a small model"))
    add_serve_arguments(commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(args)
    if args.command == "serve":
        return run_serve(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
