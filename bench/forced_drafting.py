"""A speculative step's grammar-forced drafting work on the CPU, the whole batch in one call
against one request at a time. JSON lines.

The server drafts forced chains by default. Per step and request (``engine/spec/forced.py``):

- ``catch_up``: with ``EngineConfig.grammar_after_launch`` the request's matcher is behind by
  the last step's tokens when the next step drafts, so its chains are drafted from a fork
  caught up with them (``caught_up``);
- ``leaves``: forced chains are grafted below the draft's best leaves, each probed on a fork of
  that grammar replaying the leaf's path (``extend_leaves``).

Both run on the engine thread before the launch. ``--requests`` matchers (JSONSchemaBench
instances through llguidance, the duplicate-key tracker on where a schema has free keys, the
Gemma tokenizer) stand at different points of their instances with fresh masks and closing
bases, as a request's after its step's walk. Each is ``--behind`` tokens behind, and its draft
has two leaves (the instance's next 3 tokens, and a branch off its second). Per part and rep,
alternating order:

- ``each``: the function called for one request at a time (the anchor);
- ``batch``: one call for all of them (a round's forks cloned and advanced in one native call
  on ``--threads`` threads, the GIL released).

Per part and side: ``wall_ms`` (p50, p10) and ``cpu_ms`` (the calling thread's CPU time, p50:
what the engine thread itself spends); then each part's ratio line.

    .venv/bin/python bench/forced_drafting.py [--requests 32] [--behind 8] [--threads 8]
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
    from espalier.engine.spec.forced import ForcedConfig, caught_up, extend_leaves
    from espalier.engine.spec.tree_builder import NodeSource, TreeBuilder
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    pool = spec_bench.instance_pool(tokenizer, args.schemas, 2 * args.behind + 24)
    if not pool:
        raise SystemExit("no instance long enough")
    batch = BatchFiller(args.threads)
    config = ForcedConfig()
    scratch = bm.allocate(1, tokenizer.vocab_size, fill=0)

    def requests() -> tuple[list[Any], list[list[int]], list[Any]]:
        matchers, behind, drafts = [], [], []
        for i in range(args.requests):
            compiled, tokens = pool[i % len(pool)]
            matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
            at = 4 + (i % 5) * 4
            assert matcher.accept_tokens(tokens[:at]) == at
            matcher.fill_bitmask(scratch, 0)  # a request's matcher has its step's mask made
            matcher.fork()  # and a closing base (the engine's walks keep one): forks reuse it
            matchers.append(matcher)
            behind.append(tokens[at : at + args.behind])
            builder = TreeBuilder(tokens[at - 1])
            builder.add_path(0, tokens[at : at + 3], [-0.1] * 3, NodeSource.MODEL)
            builder.add_path(0, [tokens[at], tokens[at + 1] + 1], [-0.1, -0.5], NodeSource.MODEL)
            drafts.append(builder.build())
        return matchers, behind, drafts

    budgets = [2 * args.behind] * args.requests
    parts: dict[str, dict[str, Callable[[list[Any], list[list[int]], list[Any]], list[Any]]]] = {
        "catch_up": {
            "each": lambda ms, bs, ds: [caught_up(batch, [m], [b])[0] for m, b in zip(ms, bs)],
            "batch": lambda ms, bs, ds: caught_up(batch, ms, bs),
        },
        "leaves": {
            "each": lambda ms, bs, ds: [
                extend_leaves(batch, [d], [m], budgets[:1], config)[0] for m, d in zip(ms, ds)
            ],
            "batch": lambda ms, bs, ds: extend_leaves(batch, ds, ms, budgets, config),
        },
    }
    for part, sides in parts.items():
        wall: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        made: dict[str, int] = {}
        for rep in range(args.reps):
            for name in sides if rep % 2 else reversed(sides):
                matchers, behind, drafts = requests()
                start, thread = time.perf_counter(), time.thread_time()
                out = sides[name](matchers, behind, drafts)
                wall[name].append((time.perf_counter() - start) * 1e3)
                cpu[name].append((time.thread_time() - thread) * 1e3)
                if any(x is None for x in out):
                    raise SystemExit(f"{part} {name}: a fork rejected its instance's tokens")
                if part == "leaves":
                    made[name] = sum(d.num_nodes for d in out)
        if part == "leaves" and made["each"] != made["batch"]:
            raise SystemExit(f"leaves: {made} nodes: the sides' trees differ")
        for name in sides:
            ordered = sorted(wall[name])
            emit(
                {
                    "part": part,
                    "side": name,
                    "requests": args.requests,
                    "behind": args.behind,
                    "threads": args.threads,
                    "wall_ms_p50": round(statistics.median(ordered), 3),
                    "wall_ms_p10": round(ordered[len(ordered) // 10], 3),
                    "cpu_ms_p50": round(statistics.median(cpu[name]), 3),
                    **({"tree_nodes": made[name]} if part == "leaves" else {}),
                }
            )
        emit(
            {
                "part": part,
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
