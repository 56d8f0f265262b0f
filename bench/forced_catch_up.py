"""A speculative step's forced-chain catch-up on the CPU, one batch call against a fork and an
accept per request. JSON lines.

With ``EngineConfig.grammar_after_launch`` a request's matcher is behind by the last step's
tokens when the next step drafts, so its grammar-forced chains are drafted from a fork caught
up with them (``engine/spec/forced.py`` ``caught_up``), on the engine thread before the launch.
``--requests`` matchers (JSONSchemaBench instances through llguidance, the duplicate-key tracker
on where a schema has free keys, the Gemma tokenizer) stand at different points of their
instances with fresh masks and closing bases, as a request's after its step's walk; each is
``--behind`` tokens behind. Per rep, alternating order:

- ``each``: ``matcher.fork()`` then ``accept_tokens(behind)`` per request (the anchor);
- ``batch``: ``forced.caught_up`` over all of them (one ``BatchFiller.accept_runs``: the forks'
  clones and accepts in one native call on ``--threads`` threads, the GIL released).

Per side: ``wall_ms`` (p50, p10) and ``cpu_ms`` (the calling thread's CPU time, p50: what the
engine thread itself spends); then the ratio line.

    .venv/bin/python bench/forced_catch_up.py [--requests 32] [--behind 8] [--threads 8]
        [--reps 40] [--schemas 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import spec as spec_bench  # bench/spec.py (this folder is on sys.path)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--behind", type=int, default=8)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--schemas", type=int, default=6)
    args = parser.parse_args(argv)

    from espalier.constrained import bitmask as bm
    from espalier.constrained.batch import BatchFiller
    from espalier.constrained.keys import with_unique_keys
    from espalier.engine.spec.forced import caught_up
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    pool = spec_bench.instance_pool(tokenizer, args.schemas, 2 * args.behind + 24)
    if not pool:
        raise SystemExit("no instance long enough")
    batch = BatchFiller(args.threads)
    scratch = bm.allocate(1, tokenizer.vocab_size, fill=0)

    def requests() -> tuple[list[Any], list[list[int]]]:
        matchers, behind = [], []
        for i in range(args.requests):
            compiled, tokens = pool[i % len(pool)]
            matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
            at = 4 + (i % 5) * 4
            assert matcher.accept_tokens(tokens[:at]) == at
            matcher.fill_bitmask(scratch, 0)  # a request's matcher has its step's mask made
            matcher.fork()  # and a closing base (the engine's walks keep one): forks reuse it
            matchers.append(matcher)
            behind.append(tokens[at : at + args.behind])
        return matchers, behind

    def each(matchers: list[Any], behind: list[list[int]]) -> list[Any]:
        forks = [m.fork() for m in matchers]
        return [f if f.accept_tokens(b) == len(b) else None for f, b in zip(forks, behind)]

    def together(matchers: list[Any], behind: list[list[int]]) -> list[Any]:
        return caught_up(batch, matchers, behind)

    sides: dict[str, Callable[[list[Any], list[list[int]]], list[Any]]] = {
        "each": each,
        "batch": together,
    }
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(args.reps):
        for name in sides if rep % 2 else reversed(sides):
            matchers, behind = requests()
            start, thread = time.perf_counter(), time.thread_time()
            forks = sides[name](matchers, behind)
            wall[name].append((time.perf_counter() - start) * 1e3)
            cpu[name].append((time.thread_time() - thread) * 1e3)
            if any(f is None for f in forks):
                raise SystemExit(f"{name}: a fork rejected its instance's tokens")
    for name in sides:
        ordered = sorted(wall[name])
        emit(
            {
                "part": "forced_catch_up",
                "side": name,
                "requests": args.requests,
                "behind": args.behind,
                "threads": args.threads,
                "wall_ms_p50": round(statistics.median(ordered), 3),
                "wall_ms_p10": round(ordered[len(ordered) // 10], 3),
                "cpu_ms_p50": round(statistics.median(cpu[name]), 3),
            }
        )
    emit(
        {
            "part": "forced_catch_up",
            "batch_over_each_wall": round(
                statistics.median(wall["batch"]) / statistics.median(wall["each"]), 3
            ),
            "batch_over_each_cpu": round(
                statistics.median(cpu["batch"]) / statistics.median(cpu["each"]), 3
            ),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
