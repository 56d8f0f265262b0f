"""The duplicate-key filter per row and per draft tree: native (``constrained/keys/``) against
the Python tracker it replaced (read from git at ``--anchor``, default f7aeffc: the anchor, in
the same process, on the same rows), printing JSON lines.

Inputs: JSONSchemaBench schemas that admit free keys (``may_repeat_keys``) with a valid
instance, compiled with llguidance for the real Gemma tokenizer (262,144 ids). Each instance is
walked token by token; at each position the backend's row (plain step) and the backend's rows of
the draft tree made of the next ``--draft`` instance tokens (oracle drafts, as bench/gpu.py) are
filtered by both trackers from the same key state. Results are checked equal, then timed
(median of ``--reps`` per input, summed over inputs):

- ``row_us``: one row's filter (native ``filter_row``; anchor ``UniqueKeysMatcher._filter``);
- ``tree_us``: one tree's filter after the backend's walk (native ``filter_tree``; anchor the
  loop of its ``fill_tree``), each with the row copy both do subtracted (``copy_us``);
- ``batch_rows_us``: the batch's rows in one native ``filter_rows`` call, per row.

    .venv/bin/python bench/keys.py [--schemas 40] [--positions 12] [--draft 8] [--reps 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import spec as spec_bench  # bench/spec.py (this folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def load_anchor(rev: str) -> tuple[ModuleType, ModuleType]:
    """The anchor's ``constrained/json_keys.py`` and ``constrained/unique_keys.py`` from git."""
    modules = []
    for name in ("json_keys", "unique_keys"):
        source = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:constrained/{name}.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        full = f"espalier.constrained.{name}"  # the anchor's own import name
        spec = importlib.util.spec_from_loader(full, loader=None)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        exec(compile(source, f"{rev}:{name}.py", "exec"), module.__dict__)
        modules.append(module)
    return modules[0], modules[1]


def median_us(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def row_times(
    matcher: Any, anchor: Any, state: Any, reps: int
) -> tuple[np.ndarray, dict[str, Any]]:
    """The backend's row at the matcher's state, and the filter's µs (native, anchor; the row
    copy both need subtracted), after checking both give the same row."""
    from espalier.constrained import bitmask as bm

    row = bm.allocate(1, matcher.vocab_size, fill=0)
    matcher.inner.fill_bitmask(row, 0)
    plain = row[0].numpy()
    mine, theirs = plain.copy(), plain.copy()
    matcher.keys.filter_row(mine)
    anchor._filter(theirs, state)
    assert np.array_equal(mine, theirs)
    scratch = plain.copy()

    def native() -> None:
        scratch[:] = plain
        matcher.keys.filter_row(scratch)

    def anchored() -> None:
        scratch[:] = plain
        anchor._filter(scratch, state)

    def copy() -> None:
        scratch[:] = plain

    base = median_us(copy, reps)
    return plain, {
        "changed": int(not np.array_equal(mine, plain)),
        "native": median_us(native, reps) - base,
        "anchor": median_us(anchored, reps) - base,
    }


def tree_times(matcher: Any, anchor: Any, tree: Any, reps: int) -> dict[str, Any]:
    """The backend's walk of ``tree`` once, then each wrapper's ``fill_tree`` over a copy of
    it (µs, the copy subtracted), after checking both give the same rows and flags."""
    from espalier.constrained import bitmask as bm
    from espalier.constrained.tree.masks import TreeMasks, fill_tree_bitmask

    out = bm.allocate(tree.num_nodes, matcher.vocab_size, fill=0)
    walked = fill_tree_bitmask(matcher.inner, tree, out, None)
    rows = out.numpy().copy()
    flags = (walked.valid.copy(), walked.filled.copy(), walked.terminated.copy())
    work = out.numpy()

    def fake_fill(*_: Any, **__: Any) -> TreeMasks:
        work[:] = rows
        return TreeMasks(*(f.copy() for f in flags))

    class Prewalked:
        """The backend's matcher, its walk replayed by ``fake_fill``: the wrapper's
        ``fill_tree`` (``inner.fill_tree``, then its filter) times its filter alone."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def fill_tree(self, *_: Any, **__: Any) -> TreeMasks:
            return fake_fill()

    inner = matcher.inner
    matcher.inner = Prewalked(inner)
    try:
        theirs = anchor.fill_tree(fake_fill, tree, out)  # the anchor's (older) signature
        their_rows = work.copy()
        mine = matcher.fill_tree(tree, out, budget=None)
        assert np.array_equal(work, their_rows)
        for a, b in zip(
            (mine.valid, mine.filled, mine.terminated),
            (theirs.valid, theirs.filled, theirs.terminated),
            strict=True,
        ):
            assert np.array_equal(a, b)
        base = median_us(fake_fill, reps)
        return {
            "cut": int(flags[0].sum() - mine.valid.sum()),
            "copy": base,
            "native": median_us(lambda: matcher.fill_tree(tree, out, budget=None), reps) - base,
            "anchor": median_us(lambda: anchor.fill_tree(fake_fill, tree, out), reps) - base,
        }
    finally:
        matcher.inner = inner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schemas", type=int, default=40)
    parser.add_argument("--positions", type=int, default=12)
    parser.add_argument("--draft", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--anchor", default="f7aeffc")
    args = parser.parse_args()

    import torch

    from espalier.constrained import bitmask as bm
    from espalier.constrained.keys import may_repeat_keys, with_unique_keys
    from espalier.constrained.keys.native import filter_rows
    from espalier.constrained.spec import GrammarSpec
    from espalier.constrained.tree import DraftTree
    from espalier.server.default_model import default_tokenizer

    old_keys, old_unique = load_anchor(args.anchor)
    tokenizer = default_tokenizer()
    tables = old_keys.KeyTables.build(tokenizer)
    words = bm.words_per_row(tokenizer.vocab_size)
    totals = {"row_native": 0.0, "row_anchor": 0.0, "tree_native": 0.0, "tree_anchor": 0.0}
    totals.update(tree_copy=0.0)
    rows_n = trees_n = schemas_n = nodes_n = cut_n = changed_n = 0
    batch_trackers: list[Any] = []
    batch_rows: list[np.ndarray] = []
    for _, schema, instances in spec_bench.sample_schemas(args.schemas, with_instances=True):
        if not may_repeat_keys(GrammarSpec.json_schema(schema)):
            continue
        compiled = spec_bench.compile_schema(schema, tokenizer)
        if compiled is None:
            continue
        text = json.dumps(instances[0])
        tokens = tokenizer.encode(text)
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
        if matcher.accept_tokens(tokens) != len(tokens):
            continue
        matcher.rollback(len(tokens))
        schemas_n += 1
        step = max(1, len(tokens) // args.positions)
        state = old_keys.START
        for at in range(len(tokens) + 1):
            if at % step == 0:
                anchor = old_unique.UniqueKeysMatcher(matcher.inner, tables, tokenizer, [state])
                plain, row = row_times(matcher, anchor, state, args.reps)
                changed_n += row["changed"]
                totals["row_native"] += row["native"]
                totals["row_anchor"] += row["anchor"]
                rows_n += 1
                batch_trackers.append(matcher.fork().keys)
                batch_rows.append(plain)
                draft = tokens[at : at + args.draft]
                if draft:
                    root = tokens[at - 1] if at else 0
                    tree = DraftTree.from_parents([root, *draft], [-1, *range(len(draft))])
                    times = tree_times(matcher, anchor, tree, args.reps)
                    nodes_n += tree.num_nodes
                    cut_n += times["cut"]
                    for name in ("native", "anchor", "copy"):
                        totals[f"tree_{name}"] += times[name]
                    trees_n += 1
            if at < len(tokens):
                assert matcher.accept(tokens[at])
                state = old_keys.step(state, tokenizer.token_bytes[tokens[at]])
    # the batch call over every row met (one tracker each), on 1 and 2 threads: the call alone
    stacked = np.stack(batch_rows)
    bitmask = stacked.copy()
    for threads in (1, 2):
        times = []
        for _ in range(args.reps):
            bitmask[:] = stacked
            start = time.perf_counter()
            filter_rows(batch_trackers, bitmask, list(range(len(batch_rows))), threads)
            times.append(time.perf_counter() - start)
        per_row = 1e6 * statistics.median(times) / len(batch_rows)
        emit({"part": "keys_batch", "rows": len(batch_rows), "threads": threads,
              "batch_rows_us_per_row": round(per_row, 2)})  # fmt: skip
    emit(
        {
            "part": "keys",
            "anchor": args.anchor,
            "schemas": schemas_n,
            "rows": rows_n,
            "rows_changed": changed_n,
            "trees": trees_n,
            "tree_nodes": nodes_n,
            "nodes_cut": cut_n,
            "row_us_native": round(totals["row_native"] / rows_n, 2),
            "row_us_anchor": round(totals["row_anchor"] / rows_n, 2),
            "row_anchor_over_native": round(totals["row_anchor"] / totals["row_native"], 1),
            "tree_us_native": round(totals["tree_native"] / trees_n, 2),
            "tree_us_anchor": round(totals["tree_anchor"] / trees_n, 2),
            "tree_anchor_over_native": round(totals["tree_anchor"] / totals["tree_native"], 1),
            "copy_us": round(totals["tree_copy"] / trees_n, 2),
            "words": words,
            "torch": torch.__version__,
        }
    )


if __name__ == "__main__":
    main()
