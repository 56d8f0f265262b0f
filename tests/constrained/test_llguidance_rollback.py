"""llguidance keeps its last-mask memo across ``rollback`` (``backends/llguidance.py``).

The smallest case, on Gemma's vocabulary and any JSON::

    "[" ── '["'  (mask computed here, then rolled back)
       └── ' "'  mask must equal a fresh matcher's after "[", ' "'

Both children end inside a string with the same lexer state and Earley row index, one array
deep vs two; llguidance alone answers the second with the first's mask (``"]"`` allowed,
``"]]"`` too). The tree case is JSONSchemaBench Github_medium/o8469.json, where rows of a
256-node tree differed from a fresh replay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import get_backend
from espalier.constrained.backends.common import BackendOptions
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.masks import fill_tree_bitmask
from espalier.constrained.tree.walk import WalkResult, walk_generic

pytest.importorskip("llguidance")

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / ".data" / "jsonschemabench" / "Github_medium" / "o8469.json"


def ids(tokenizer: Any, text: str) -> list[int]:
    tokens: list[int] = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes[t] for t in tokens) == text.encode()
    return tokens


def fresh_row(compiled: Any, path: list[int]) -> np.ndarray:
    matcher = compiled.matcher()
    for token in path:
        assert matcher.accept(token)
    row = bm.allocate(1, matcher.vocab_size, fill=0)
    matcher.fill_bitmask(row, 0)
    return row.numpy()[0].copy()


@pytest.mark.model
def test_accept_after_rollback_matches_fresh_replay(gemma_tokenizer: Any) -> None:
    compiled = get_backend("llguidance", gemma_tokenizer).compile(GrammarSpec.any_json())
    (outer,), (nested,), (spaced,) = (ids(gemma_tokenizer, t) for t in ("[", '["', ' "'))
    matcher = compiled.matcher()
    row = bm.allocate(1, matcher.vocab_size, fill=0)
    assert matcher.accept(outer)
    matcher.fill_bitmask(row, 0)
    assert matcher.accept(nested)
    matcher.fill_bitmask(row, 0)
    matcher.rollback(1)
    assert matcher.accept(spaced)
    matcher.fill_bitmask(row, 0)
    assert np.array_equal(row.numpy()[0], fresh_row(compiled, [outer, spaced]))


@pytest.mark.model
@pytest.mark.parametrize("walker", ["native", "budgeted", "generic"])
def test_tree_rows_after_rollback_match_fresh_replay(gemma_tokenizer: Any, walker: str) -> None:
    """The same state class reached by every tree walker (Github_medium/o8469.json): the native
    one (C, siblings on clones), without and with a budget ("budgeted"), and the generic one."""
    if not SCHEMA.exists():
        pytest.skip(f"{SCHEMA} is missing")
    schema = json.loads(SCHEMA.read_text())["schema"]
    backend = get_backend("llguidance", gemma_tokenizer, BackendOptions())
    compiled = backend.compile(GrammarSpec.json_schema(schema))
    prefix = ids(gemma_tokenizer, '{"a":')
    #   root ─ '["' ─ "b"     (masks computed on the way down, then rolled back)
    #        └ ' "' ─ "b"     every row must equal a fresh replay
    first = ids(gemma_tokenizer, '["b')
    second = ids(gemma_tokenizer, ' "b')
    assert len(first) == len(second) == 2
    tokens = [0, *first, *second]
    n = len(tokens)
    chain_ends = {len(first), n - 1}  # two chains under the root: 1..len(first), then the rest
    first_child = [1] + [-1 if i in chain_ends else i + 1 for i in range(1, n)]
    next_sibling = [-1] * n
    next_sibling[1] = len(first) + 1
    tree = DraftTree(np.array(tokens), np.array(first_child), np.array(next_sibling))
    matcher = compiled.matcher()
    for token in prefix:
        assert matcher.accept(token)
    out = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0)
    if walker != "generic":
        budget = 60.0 if walker == "budgeted" else None
        masks = fill_tree_bitmask(matcher, tree, out, budget)
        assert not masks.budget_hit
        assert matcher.history == prefix  # the walk ran on clones
        valid = list(masks.valid)
    else:
        rows = out.numpy()[:n]
        valid = walk_generic(matcher, tree, rows, float("inf"), False, WalkResult.empty(n)).valid
    assert all(valid)
    for node in range(n):
        expected = fresh_row(compiled, prefix + tree.path(node))
        assert np.array_equal(out.numpy()[node], expected), node
    # a walk down the first chain alone leaves the matcher where it found it, memo included
    alone = DraftTree(np.array([0, *first]), np.array([1, 2, -1]), np.array([-1, -1, -1]))
    if walker != "generic":
        fill_tree_bitmask(matcher, alone, out, 60.0 if walker == "budgeted" else None)
    else:
        walk_generic(matcher, alone, out.numpy()[:3], float("inf"), False, WalkResult.empty(3))
    assert matcher.accept(second[0])
    row = bm.allocate(1, gemma_tokenizer.vocab_size, fill=0)
    matcher.fill_bitmask(row, 0)
    assert np.array_equal(row.numpy()[0], fresh_row(compiled, prefix + second[:1]))
