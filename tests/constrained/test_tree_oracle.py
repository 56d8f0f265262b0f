"""The tree-mask ORACLE: every fast path vs. replaying each path on a fresh matcher.

Random EAGLE-like trees (``tests/fixtures/tree_random.py``: 1-256 nodes, depth <= 16, grammar-valid,
invalid and random ids, stop tokens, terminated paths) over regexes, GBNF grammars and JSON
schemas, on all three backends (llguidance's native walk, ``constrained/backends/llguidance/
native/``: a second thread shares big trees every other tree). Toy vocabularies always; the Gemma
tokenizer with
JSONSchemaBench schemas and the shared GBNF grammars under ``model`` (a representative part) and
all of it under ``slow`` / ``ESPALIER_SLOW=1``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import BACKENDS, get_backend
from espalier.constrained.backends.common import BackendOptions
from espalier.constrained.errors import GrammarError
from espalier.constrained.spec import GrammarKind, GrammarSpec
from espalier.constrained.tree.masks import fill_tree_bitmask
from tests.fixtures.jsonschemabench import SHARED, schema_cases
from tests.fixtures.tree_oracle import compare, replay_tree
from tests.fixtures.tree_random import grow_tree, sample_instance

SLOW = os.environ.get("ESPALIER_SLOW") == "1"

TOY_GRAMMARS = [
    GrammarSpec.regex("(ab|cd)*e"),
    GrammarSpec.regex("[0-9]{1,3}(\\.[0-9]+)?"),
    GrammarSpec.regex("(true|false|null)"),
    GrammarSpec.json_schema(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name"],
        }
    ),
    GrammarSpec.ebnf('root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+ | "ab" item'),
]


WALKS = list(BACKENDS)
"""Backends, each with its own tree walk (llguidance's native one on every tree)."""


def compile_for(walk: str, tokenizer: Any, spec: GrammarSpec) -> Any:
    """``spec`` compiled for ``walk`` (a name of :data:`WALKS`; llguidance with its C-API
    tokenizer ready)."""
    grammar = get_backend(walk, tokenizer, BackendOptions()).compile(spec)
    if walk == "llguidance":
        assert grammar.native_slot.wait(120) is not None, grammar.native_slot.error
    return grammar


def check_trees(
    grammar: Any, rng: np.random.Generator, trees: int, sizes: list[int], instance: Any = None
) -> tuple[int, list[str]]:
    """Grow ``trees`` random trees (cycling ``sizes``), fill them and compare with the oracle."""
    problems: list[str] = []
    nodes = 0
    for k in range(trees):
        start = grammar.matcher()
        prefix = sample_instance(start, rng, max_tokens=int(rng.integers(0, 6)))
        prefix = [t for t in prefix if t not in start.tokenizer.stop_token_ids]
        for token in prefix:
            assert start.accept(token)
        body = instance if instance is not None else sample_instance(start, rng, max_tokens=24)
        tree = grow_tree(grammar.matcher, prefix, body, sizes[k % len(sizes)], rng)
        out = bm.allocate(tree.num_nodes, start.vocab_size, fill=int(rng.integers(-1, 1)))
        oracle = replay_tree(grammar.matcher, prefix, tree)
        threads = 1 + k % 2  # the native llguidance walk shares big trees with a second thread
        masks = fill_tree_bitmask(start, tree, out, budget=None, threads=threads)
        found = compare(masks, out, tree, oracle)
        if grammar.backend == "llguidance":
            assert start.history == prefix  # the walk ran on clones: the matcher did not move
        # a budget that is never hit: the walk runs on a fork on a helper thread (traverse_bounded)
        masks = fill_tree_bitmask(start, tree, out, budget=60.0)
        found += compare(masks, out, tree, oracle) + ["budget hit"] * masks.budget_hit
        problems += [f"{grammar.spec!r} prefix={prefix}: {p}" for p in found]
        nodes += tree.num_nodes
    return nodes, problems


@pytest.mark.parametrize("backend", WALKS)
@pytest.mark.parametrize("spec", TOY_GRAMMARS, ids=lambda s: s.kind.value + s.source[:12])
def test_oracle_toy(backend: str, spec: GrammarSpec, toy_tokenizer_padded: Any) -> None:
    try:
        grammar = compile_for(backend, toy_tokenizer_padded, spec)
    except GrammarError:
        assert backend == "outlines_core" and spec.kind is GrammarKind.EBNF
        return
    rng = np.random.default_rng(len(spec.source) * 7 + WALKS.index(backend))
    trees = 120 if SLOW else 25
    nodes, problems = check_trees(grammar, rng, trees, [1, 3, 8, 16, 32, 64, 128, 256])
    assert nodes > trees
    assert problems == []


# -- Gemma tokenizer: JSONSchemaBench schemas and the shared GBNF grammars ----------------------


@pytest.mark.model
@pytest.mark.parametrize("backend", WALKS)
def test_oracle_gemma_schemas(backend: str, gemma_tokenizer: Any) -> None:
    rng = np.random.default_rng(WALKS.index(backend))
    per_subset = 12 if SLOW else 1
    trees = 12 if SLOW else 2
    cases = schema_cases(per_subset)
    checked = 0
    problems: list[str] = []
    for name, schema, data in cases if SLOW else cases[:3]:
        try:
            grammar = compile_for(backend, gemma_tokenizer, GrammarSpec.json_schema(schema))
        except GrammarError:
            continue
        instance = gemma_tokenizer.encode(json.dumps(data)) + [gemma_tokenizer.stop_token_ids[0]]
        _, found = check_trees(grammar, rng, trees, [16, 64, 1, 256, 32], instance=instance)
        problems += [f"{name}: {p}" for p in found]
        checked += 1
    assert checked >= 2
    assert problems == []


@pytest.mark.model
@pytest.mark.parametrize("backend", WALKS)
def test_oracle_gemma_gbnf_and_regex(backend: str, gemma_tokenizer: Any) -> None:
    names = sorted(p.name for p in (SHARED / "grammars" / "gbnf").glob("*.gbnf"))
    if not SLOW:  # arithmetic: llguidance refuses it (greedy lexemes), chess: both take it
        names = [n for n in names if n in ("arithmetic.gbnf", "chess.gbnf")]
    specs = [GrammarSpec.ebnf((SHARED / "grammars" / "gbnf" / n).read_text()) for n in names]
    specs += [GrammarSpec.regex(r"\d{3}-\d{4}( ext\. \d+)?")]
    rng = np.random.default_rng(11)
    problems: list[str] = []
    checked = 0
    for spec in specs:
        try:
            grammar = compile_for(backend, gemma_tokenizer, spec)
        except GrammarError:
            continue
        nodes, found = check_trees(grammar, rng, 10 if SLOW else 2, [32, 16, 128])
        problems += found
        checked += nodes
    assert checked > 0  # at least one grammar compiled and was checked
    assert problems == []


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="set ESPALIER_SLOW=1 for the full oracle sweep")
@pytest.mark.parametrize("backend", WALKS)
def test_oracle_toy_sweep(backend: str, toy_tokenizer: Any) -> None:
    problems: list[str] = []
    for spec in TOY_GRAMMARS:
        try:
            grammar = compile_for(backend, toy_tokenizer, spec)
        except GrammarError:
            continue
        rng = np.random.default_rng(1000 + len(spec.source))
        _, found = check_trees(grammar, rng, 400, [1, 2, 5, 16, 64, 256])
        problems += found
    assert problems == []
