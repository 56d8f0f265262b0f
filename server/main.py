"""The ``espalier`` command. Each subcommand lives in its own module exposing ``register(sub)``.

A module adds its parser with ``sub.add_parser(...)`` and ``set_defaults(func=run)`` where
``run(args) -> int``; heavy imports belong inside ``run``. Modules not present are skipped, so a
subcommand appears as soon as its module lands.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Sequence

CACHE_DIR_ENV = "ESPALIER_CACHE_DIR"

SUBCOMMAND_MODULES = (
    "espalier.server.cli_serve",
    "espalier.server.cli_generate",
    "espalier.server.cli_conformance",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="espalier", description="Grammar-constrained LLM generation over gRPC."
    )
    parser.add_argument(
        "--cache-dir",
        default=os.environ.get(CACHE_DIR_ENV),
        help=f"folder for converted models and tokenizers (env {CACHE_DIR_ENV}; "
        "default ~/.cache/espalier)",
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
    if args.cache_dir:
        from espalier.constrained.tokenizer import set_cache_root

        set_cache_root(args.cache_dir)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
