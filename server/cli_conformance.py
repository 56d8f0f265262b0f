"""``espalier conformance PATH``: run JSON Schema test files through a grammar backend.

Prints one JSON line per file, then one JSON line with the keys
``schemas, compiled, refused, tests, passed, false_accept, false_reject, runtime_error``, always
(also when the run stops early: then after an error on stderr, with exit status 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "conformance",
        help="check a grammar backend against JSON Schema test files",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help="a test file, or a folder searched recursively")
    p.add_argument("--backend", default="auto", help="auto | xgrammar | llguidance | outlines_core")
    p.add_argument(
        "--tokenizer", default=None, help="Hugging Face tokenizer folder (default: embedded Gemma)"
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument(
        "--remotes",
        default=None,
        help="folder served at http://localhost:1234/ (default: the test suite's remotes/)",
    )
    p.add_argument("--include-optional", action="store_true", help="also run files under optional/")
    p.add_argument("--sample", type=int, default=0, help="run every N-th file only (N > 1)")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="visit subfolders round-robin, so a partial run is a fair sample",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="compile time limit, seconds")
    p.add_argument("--failures", default=None, help="write every failure as JSON lines here")
    p.add_argument("--quiet", action="store_true", help="print the summary line only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from espalier.constrained.conformance import (
        RunConfig,
        find_files,
        find_remotes,
        interleave,
        result_row,
        run_files,
        total,
    )
    from espalier.server.default_model import default_gguf

    path = Path(args.path)
    if not path.exists():
        print(f"espalier conformance: no such file or folder: {path}", file=sys.stderr)
        return 2
    files = find_files(path, include_optional=args.include_optional or "optional" in path.parts)
    if args.sample > 1:
        files = files[:: args.sample]
    if args.interleave and path.is_dir():
        files = interleave(files, path)
    remotes = args.remotes or find_remotes(path.resolve())
    config = RunConfig(
        backend=args.backend,
        tokenizer=args.tokenizer or str(default_gguf()),
        remotes=str(remotes) if remotes else None,
        timeout_s=args.timeout,
    )
    results = []
    status = 0
    failures = open(args.failures, "w", encoding="utf-8") if args.failures else None  # noqa: SIM115
    try:
        for result in run_files(files, config, jobs=args.jobs):
            results.append(result)
            if not args.quiet:
                print(json.dumps(result_row(result)), flush=True)
            if failures is not None:
                for kind, case, test, detail in result.failures:
                    record = {"file": result.path, "kind": kind, "case": case, "test": test}
                    failures.write(json.dumps({**record, "detail": detail}) + "\n")
    except Exception as exc:  # the runner itself failed (a worker died): say so, still summarise
        done = f"after {len(results)} of {len(files)} files"
        print(f"espalier conformance: stopped {done}: {type(exc).__name__}: {exc}", file=sys.stderr)
        status = 1
    finally:
        if failures is not None:
            failures.close()
        print(json.dumps(total(results)), flush=True)
    return status
