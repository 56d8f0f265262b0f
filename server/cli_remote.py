"""``espalier generate`` as a client of a running server (the ``--local`` path is the engine's).

``add_remote_arguments`` / ``run_remote`` are shared with ``cli_generate.py``, which owns the
``generate`` subcommand once it exists; ``register`` stands in for it until then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from espalier.server.cli_serve import AUTH_TOKEN_ENV


def add_remote_arguments(p: argparse.ArgumentParser) -> None:
    """Client-side flags (the constraint and sampling flags are shared with --local)."""
    p.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT of the server")
    p.add_argument("--auth-token", default=None, help=f"bearer token (or ${AUTH_TOKEN_ENV})")
    p.add_argument("--tls-ca", default=None, help="PEM root certificate: connect with TLS")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--schema", default=None, help="JSON schema FILE")
    group.add_argument("--regex", default=None, help="regular expression")
    group.add_argument("--grammar", default=None, help="GBNF (.gbnf/.ebnf) or Lark (.lark) FILE")
    group.add_argument("--choice", action="append", default=None, help="an allowed output")
    group.add_argument("--any-json", action="store_true")
    p.add_argument("--backend", default="auto")
    p.add_argument("--allow-weakening", action="store_true")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print the whole response as JSON")


class InputFileError(ValueError):
    """A flag's input file is missing, unreadable or malformed: one line for the user."""


def load_schema_file(path: str) -> Any:
    """The JSON in ``path``; raises InputFileError with one line saying what is wrong where."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFileError(f"--schema {path}: cannot read it ({exc})") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputFileError(
            f"--schema {path}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from exc
    except RecursionError as exc:
        raise InputFileError(f"--schema {path}: the JSON is nested too deeply") from exc


def constraint_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The client's constraint keywords from the flags."""
    kw: dict[str, Any] = {"backend": args.backend, "allow_weakening": args.allow_weakening}
    if args.schema:
        kw["schema"] = load_schema_file(args.schema)
    elif args.regex:
        kw["regex"] = args.regex
    elif args.grammar:
        text = Path(args.grammar).read_text()
        kw["lark" if args.grammar.endswith(".lark") else "ebnf"] = text
    elif args.choice:
        kw["choice"] = list(args.choice)
    elif args.any_json:
        kw["any_json"] = True
    return kw


def run_remote(args: argparse.Namespace) -> int:
    from espalier_client import Client, EspalierError
    from google.protobuf import json_format

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    token = args.auth_token or os.environ.get(AUTH_TOKEN_ENV)
    root = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    try:
        constraint = constraint_kwargs(args)
    except (InputFileError, OSError, UnicodeDecodeError) as exc:
        print(f"espalier generate: {exc}", file=sys.stderr)
        return 2
    kwargs: dict[str, Any] = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        **constraint,
    )
    with Client(args.address, token=token, root_certificates=root, timeout_s=args.timeout) as c:
        try:
            if args.stream:
                last = None
                for chunk in c.stream(prompt, **kwargs):
                    if not args.json:
                        print(chunk.text, end="", flush=True)
                    last = chunk
                if args.json and last is not None:
                    print(json_format.MessageToJson(last.raw, indent=None))
                elif not args.json:
                    print()
            else:
                result = c.generate(prompt, **kwargs)
                if args.json:
                    print(json_format.MessageToJson(result.raw, indent=None))
                else:
                    print(result.text)
        except EspalierError as exc:
            print(f"espalier generate: {exc}", file=sys.stderr)
            return 1
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate with a running server")
    add_generation_arguments(p)
    add_remote_arguments(p)
    p.set_defaults(func=run_remote)
