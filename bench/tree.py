"""``python bench/tree.py DIR``: time tree masks on EAGLE-like trees grown from JSON schemas.

Per tree size (``--nodes``), on the same trees: the seed's algorithm (a recursive Python DFS
indexing torch tensors one element at a time, on xgrammar), xgrammar's native
``traverse_draft_tree`` called directly, and espalier's ``fill_tree_bitmask`` per backend without a
budget (best of ``--repeat``) and with ``--budget`` (every repeat: p50/p99/max ms, shares of fills
cut by the budget, abandoned during one slow native fill, within the budget and within it + 1 ms;
the slowest fill with its schema, position and root-row fill time, the part no budget cuts).
``auto`` is what a user gets by default: per schema the backend ``backend="auto"`` picks (strict
mode), measured on the same trees. Then batch scaling: ``--batch`` trees filled as ``fill_tree``
tasks on a pool of 1..N threads, without a budget and with it. Oracle mismatches are counted on
up to ``--oracle-trees`` trees per size and backend, with and without the budget. Trees:
``tests/fixtures/tree_random.py`` (topk 4; the first child follows a valid instance, the others mix
grammar-valid, stop and random tokens), rooted at a random point of the instance. One JSON line per
measurement; the last line is one JSON object keyed by tree size (``espalier_p50_ms`` is
xgrammar's, as ``espalier_backend`` says; each backend and ``auto`` have their own keys).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/tree.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", help="folder of JSONSchemaBench files (searched recursively)")
    p.add_argument("--nodes", default="16,32,64", help="tree sizes, comma-separated")
    p.add_argument("--batch", type=int, default=32, help="trees per batch for thread scaling")
    p.add_argument("--backend", default="xgrammar,llguidance,outlines_core")
    p.add_argument("--schemas", type=int, default=40, help="schemas to use at most")
    p.add_argument("--trees", type=int, default=100, help="trees per size")
    p.add_argument("--repeat", type=int, default=3, help="timed fills per tree (min kept)")
    p.add_argument("--oracle-trees", type=int, default=20, help="trees per size checked by oracle")
    p.add_argument("--budget", type=float, default=0.002, help="budget of the bounded run (s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="max batch threads")
    p.add_argument(
        "--compile-timeout",
        type=float,
        default=30.0,
        help="seconds a schema's compile may take (tried first in a child process, killed "
        "past it; the schema is then skipped for that backend)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import tree_run  # bench/tree_run.py (this folder is on sys.path)

    args = parse_args(argv)
    sizes = [int(s) for s in args.nodes.split(",") if s]
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    summary = tree_run.run_benchmark(
        Path(args.dir),
        sizes=sizes,
        backends=backends,
        batch=args.batch,
        max_schemas=args.schemas,
        trees_per_size=args.trees,
        repeat=args.repeat,
        oracle_trees=args.oracle_trees,
        budget=args.budget,
        max_threads=args.threads,
        compile_timeout=args.compile_timeout,
        seed=args.seed,
        emit=lambda record: print(json.dumps(record), flush=True),
    )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
