"""The unique-item filter's cost per row: the backend's fill alone (the anchor, same process,
same rows) against the wrapped matcher's fill (the backend's row, then the native tracker's
filter), printing JSON lines.

Inputs: JSONSchemaBench schemas whose ``uniqueItems`` the tracker follows (marked at compile
time: ``schema/unique_places.py``) with a valid instance holding a non-empty array, compiled
with llguidance for the real Gemma tokenizer (262,144 ids). Each instance is walked token by
token; at up to ``--positions`` positions per instance the two fills are timed (median of
``--reps``), summed over inputs:

- ``backend_us``: ``inner.fill_bitmask`` (llguidance's row);
- ``wrapped_us``: ``UniqueKeysMatcher.fill_bitmask`` (the same row, then ``filter_row``);
- ``filter_us``: their difference, per row; ``rows_changed``: rows that lost a token.

    .venv/bin/python bench/unique_items.py [--root .data/jsonschemabench] [--schemas 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _has_array(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value)
    if isinstance(value, dict):
        return any(_has_array(v) for v in value.values())
    return False


def _inputs(root: Path, limit: int) -> list[tuple[str, Any, Any]]:
    from espalier.constrained.compile import prepare_schema
    from espalier.constrained.schema.unique_places import MARK

    found: list[tuple[str, Any, Any]] = []
    for path in sorted(root.rglob("*.json")):
        if len(found) >= limit:
            break
        text = path.read_text()
        if '"uniqueItems": true' not in text and '"uniqueItems":true' not in text:
            continue
        case = json.loads(text)
        schema = case.get("schema")
        tests = [t["data"] for t in case.get("tests", []) if t.get("valid")]
        valid = [d for d in tests if _has_array(d)]
        if not isinstance(schema, dict) or not valid:
            continue
        try:
            prepared = prepare_schema(schema)
        except Exception:  # a schema the grammar layer refuses outright: not an input
            continue
        if MARK in json.dumps(prepared.schema) and prepared.issues["llguidance"] == ():
            found.append((path.name, schema, valid[0]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default=".data/jsonschemabench")
    parser.add_argument("--schemas", type=int, default=12)
    parser.add_argument("--positions", type=int, default=24)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()

    from espalier.constrained import bitmask as bm
    from espalier.constrained.compile import compile_grammar
    from espalier.constrained.keys import with_unique_keys
    from espalier.constrained.spec import GrammarSpec
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    backend_total = wrapped_total = 0.0
    rows = changed = schemas = 0
    row = bm.allocate(1, tokenizer.vocab_size, fill=0)
    plain = bm.allocate(1, tokenizer.vocab_size, fill=0)
    for _name, schema, instance in _inputs(Path(args.root), args.schemas):
        compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, "llguidance")
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
        tokens = tokenizer.encode(json.dumps(instance))
        if matcher.accept_tokens(tokens) != len(tokens):
            continue
        matcher.rollback(len(tokens))
        schemas += 1
        step = max(1, len(tokens) // args.positions)
        for at in range(len(tokens)):
            if at % step == 0:
                backend, wrapped = [], []
                for _ in range(args.reps):
                    start = time.perf_counter()
                    matcher.inner.fill_bitmask(plain, 0)
                    backend.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    matcher.fill_bitmask(row, 0)
                    wrapped.append(time.perf_counter() - start)
                backend_total += statistics.median(backend)
                wrapped_total += statistics.median(wrapped)
                changed += int(not bool((row == plain).all()))
                rows += 1
            assert matcher.accept(tokens[at])
    emit(
        {
            "part": "unique_items",
            "schemas": schemas,
            "rows": rows,
            "rows_changed": changed,
            "backend_us": round(1e6 * backend_total / max(rows, 1), 2),
            "wrapped_us": round(1e6 * wrapped_total / max(rows, 1), 2),
            "filter_us": round(1e6 * (wrapped_total - backend_total) / max(rows, 1), 2),
            "wrapped_over_backend": round(wrapped_total / max(backend_total, 1e-12), 2),
        }
    )


if __name__ == "__main__":
    main()
