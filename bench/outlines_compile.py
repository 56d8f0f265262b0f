"""outlines-core compile time with the Index built in a child process, against the anchor in the
same run: the Index built in the calling process (``BackendOptions.outlines_memory_limit=0``, the
path before ``constrained/backends/outlines_core/index.py``). Prints one JSON line.

Schemas: JSONSchemaBench's, round-robin over subsets (``bench/spec.sample_schemas``), on the
embedded Gemma tokenizer. Each is first compiled in a child under a compile cache with
``--limit-s`` (killed at it: some take minutes and many GiB); only those that compiled in time
are timed, ``--rounds`` rounds in ABBA order. Per schema the median seconds of each path; the
headline is ``child_over_in_process``, the ratio of their summed medians.

    .venv/bin/python bench/outlines_compile.py [--schemas 16] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import spec as spec_bench  # bench/spec.py (this folder is on sys.path)


def _seconds(backend: Any, spec: Any) -> float:
    start = time.perf_counter()
    backend.compile(spec)
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    from espalier.constrained.backends import get_backend
    from espalier.constrained.backends.common import BackendOptions
    from espalier.constrained.cache import CacheKey, CompileCache
    from espalier.constrained.errors import CompileTimeoutError, GrammarError
    from espalier.constrained.spec import GrammarSpec
    from espalier.server.default_model import default_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemas", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--limit-s", type=float, default=20.0, help="compile time limit")
    args = parser.parse_args(argv)

    tokenizer = default_tokenizer()
    child = get_backend("outlines_core", tokenizer)
    in_process = get_backend("outlines_core", tokenizer, BackendOptions(outlines_memory_limit=0))
    assert child.builder is not None and in_process.builder is None
    cache = CompileCache(timeout_s=args.limit_s)
    kept: list[tuple[str, Any]] = []
    refused = timed_out = 0
    for name, schema, _ in spec_bench.sample_schemas(args.schemas, False):
        spec = GrammarSpec.json_schema(schema)
        key = CacheKey(spec.cache_key, "outlines_core", tokenizer.fingerprint)
        try:
            cache.get(key, lambda spec=spec: (child.compile(spec), None))  # type: ignore[misc]
        except CompileTimeoutError:
            timed_out += 1
            continue
        except GrammarError:
            refused += 1
            continue
        kept.append((name, spec))
    cache.close()
    times: dict[str, dict[str, list[float]]] = {n: {"child": [], "in_process": []} for n, _ in kept}
    for r in range(args.rounds):
        order = [("child", child), ("in_process", in_process)]
        for label, backend in order if r % 2 == 0 else order[::-1]:
            for name, spec in kept:
                times[name][label].append(_seconds(backend, spec))
    medians = {
        name: {label: statistics.median(values) for label, values in paths.items()}
        for name, paths in times.items()
    }
    total_child = sum(m["child"] for m in medians.values())
    total_here = sum(m["in_process"] for m in medians.values())
    record = {
        "part": "outlines_compile",
        "schemas": len(kept),
        "refused": refused,
        "timed_out": timed_out,
        "rounds": args.rounds,
        "child_s_total": round(total_child, 3),
        "in_process_s_total": round(total_here, 3),
        "child_over_in_process": round(total_child / total_here, 3) if total_here else None,
        "per_schema_s": {
            name: [round(m["child"], 4), round(m["in_process"], 4)] for name, m in medians.items()
        },
        "children_started": child.builder.started,
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
