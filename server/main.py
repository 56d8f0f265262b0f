"""The ``espalier`` command. Each subcommand lives in its own module exposing ``register(sub)``.

A module adds its parser with ``sub.add_parser(...)`` and ``set_defaults(func=run)`` where
``run(args) -> int``; heavy imports belong inside ``run``. Modules not present are skipped, so a
subcommand appears as soon as its module lands.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

SUBCOMMAND_MODULES = (
    "espalier.server.cli_serve",
    "espalier.server.cli_generate",
    "espalier.server.cli_conformance",
    "espalier.server.cli_bench_tree",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="espalier", description="Grammar-constrained LLM generation over gRPC."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)
    if "generate" not in sub.choices:
        # Until the in-process (--local) generate lands, the client-only one stands in.
        from espalier.server import cli_remote

        cli_remote.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
