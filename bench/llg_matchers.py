"""llguidance's two matcher APIs side by side, for the choice of one C-API matcher per request.

A request's llguidance state is a Python ``LLMatcher`` (made by a compile per request, issue 39;
its accepts on the engine thread) plus a C-API twin for the native tree walk. This measures, on
the same grammars and tokens (``bench/spec.py``'s JSONSchemaBench schemas, their valid
instances, the Gemma tokenizer), one JSON line per measure, each with the Python API as its
anchor in the same run:

- ``consume``: every instance consumed on new matchers, ``--run`` tokens per call (a
  speculative step's accepted run), split over 1 and over ``--threads`` Python threads:
  ``LLMatcher.try_consume_tokens`` (the engine's accept) against ``llg_matcher_consume_tokens``
  through ctypes on clones of the C-API template (ctypes releases the GIL for the call);
  ``*_speedup`` is 1 thread over ``--threads``, ``c_over_python`` the C-API time over the
  Python one at ``--threads``;
- ``make``: a request's new matcher, ``compiled.matcher()`` (a compile, the anchor) against a
  clone of the grammar's warmed C-API template;
- ``fork``: a copy of a matcher that has consumed a whole instance, ``LLMatcher.deep_copy`` (it
  shares the lexer; the anchor) against ``llg_clone_matcher`` (it copies it).

``make`` and ``fork`` give µs per matcher and ``ratio``, the other's time over the anchor's.
Times are the best of ``--reps`` (wall, this process).

    .venv/bin/python bench/llg_matchers.py [--schemas 6] [--instances 3] [--threads 2] [--run 8]
        [--reps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import spec as spec_bench  # bench/spec.py (this folder is on sys.path)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def best(reps: int, setup: Callable[[], Any], timed: Callable[[Any], None]) -> float:
    """Best wall seconds of ``timed(setup())`` over ``reps`` runs (setup not timed)."""
    times = []
    for _ in range(reps):
        state = setup()
        start = time.perf_counter()
        timed(state)
        times.append(time.perf_counter() - start)
    return min(times)


def split(work: Callable[[Sequence[Any]], None], items: Sequence[Any], threads: int) -> None:
    """``work`` over ``items`` dealt round-robin to ``threads`` threads, joined."""
    parts = [items[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=work, args=(part,)) for part in parts]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def python_consume(pairs: Sequence[tuple[Any, list[int]]], run: int) -> None:
    for matcher, tokens in pairs:
        for at in range(0, len(tokens), run):
            chunk = tokens[at : at + run]
            if matcher.try_consume_tokens(chunk) != len(chunk):
                raise RuntimeError("an instance token was rejected")


def c_consume(pairs: Sequence[tuple[Any, list[int]]], run: int) -> None:
    for matcher, tokens in pairs:
        consume = matcher.tokenizer.api.llg.llg_matcher_consume_tokens
        for at in range(0, len(tokens), run):
            chunk = tokens[at : at + run]
            if consume(matcher.pointer, (ctypes.c_uint32 * len(chunk))(*chunk), len(chunk)) != 0:
                raise RuntimeError(f"llguidance: {matcher.error()}")


def run(args: argparse.Namespace) -> None:
    from espalier.constrained.backends import get_backend
    from espalier.constrained.spec import GrammarSpec
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    backend = get_backend("llguidance", tokenizer)
    walk = backend.tree_walk(timeout=600)  # type: ignore[attr-defined]
    if walk != "native":
        raise SystemExit(f"the C-API walk is not available: {walk}")
    items: list[tuple[Any, list[int]]] = []
    for _, schema, instances in spec_bench.sample_schemas(args.schemas, with_instances=True):
        compiled = backend.compile(GrammarSpec.json_schema(schema))
        for instance in (instances or [])[: args.instances]:
            items.append((compiled, tokenizer.encode(json.dumps(instance))))
    tokens = sum(len(t) for _, t in items)
    emit(
        {
            "part": "llg_matchers",
            "grammars": args.schemas,
            "instances": len(items),
            "tokens": tokens,
        }
    )

    def python_pairs() -> list[tuple[Any, list[int]]]:
        return [(compiled.matcher().native, t) for compiled, t in items]

    def c_pairs() -> list[tuple[Any, list[int]]]:
        return [(compiled.native_start(), t) for compiled, t in items]

    times: dict[tuple[str, int], float] = {}
    for threads in (1, args.threads):
        for api, make, work in (
            ("python", python_pairs, python_consume),
            ("c", c_pairs, c_consume),
        ):

            def timed(pairs: Any, work: Any = work, threads: int = threads) -> None:
                split(functools.partial(work, run=args.run), pairs, threads)

            times[(api, threads)] = best(args.reps, make, timed)
    emit(
        {
            "measure": "consume",
            "threads": args.threads,
            "run": args.run,
            **{f"{api}_{n}_ms": round(1e3 * t, 2) for (api, n), t in times.items()},
            "python_speedup": round(times[("python", 1)] / times[("python", args.threads)], 3),
            "c_speedup": round(times[("c", 1)] / times[("c", args.threads)], 3),
            "c_over_python": round(times[("c", args.threads)] / times[("python", args.threads)], 3),
        }
    )

    per_item(
        "make",
        args.reps,
        len(items),
        ("compile", lambda: [c.matcher() for c, _ in items]),
        ("template_clone", lambda: [c.native_start() for c, _ in items]),
    )
    used_python = python_pairs()
    python_consume(used_python, args.run)
    used_c = c_pairs()
    c_consume(used_c, args.run)
    per_item(
        "fork",
        args.reps,
        len(items),
        ("python_deep_copy", lambda: [m.deep_copy() for m, _ in used_python]),
        ("c_clone", lambda: [m.clone() for m, _ in used_c]),
    )


def per_item(
    measure: str,
    reps: int,
    count: int,
    anchor: tuple[str, Callable[[], object]],
    other: tuple[str, Callable[[], object]],
) -> None:
    """One JSON line: µs per item of ``anchor`` and ``other`` (each doing ``count`` items, best
    of ``reps``) and ``other``'s time over the anchor's."""
    seconds = [best(reps, lambda: None, lambda _, work=work: work()) for _, work in (anchor, other)]
    emit(
        {
            "measure": measure,
            f"{anchor[0]}_us": round(1e6 * seconds[0] / count, 1),
            f"{other[0]}_us": round(1e6 * seconds[1] / count, 1),
            "ratio": round(seconds[1] / seconds[0], 4),
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=6)
    parser.add_argument("--instances", type=int, default=3, help="valid instances per schema")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--run", type=int, default=8, help="tokens per consume call")
    parser.add_argument("--reps", type=int, default=5)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
