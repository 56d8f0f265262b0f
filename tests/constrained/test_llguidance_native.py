"""llguidance's native tree walk (``constrained/native/``): the twin matcher keeps up with the
request through accepts, rollbacks, resets and forks; the budget holds inline; without a C
compiler the Python walk takes over."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import get_backend
from espalier.constrained.backends.common import BackendOptions
from espalier.constrained.native import build
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.traverse import fill_tree_bitmask
from espalier.constrained.traverse_oracle import compare, replay_tree
from espalier.constrained.tree_random import grow_tree, sample_instance

SCHEMA = GrammarSpec.json_schema(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "n": {"type": "integer"},
        },
        "required": ["name"],
    }
)


def native_grammar(tokenizer: Any, spec: GrammarSpec = SCHEMA) -> Any:
    if build.find_compiler() is None:
        pytest.skip("no C compiler: the native llguidance walk is not built here")
    grammar = get_backend("llguidance", tokenizer).compile(spec)
    assert grammar.native_slot.wait(60) is not None, grammar.native_slot.error
    return grammar


def history_of(matcher: Any) -> list[int]:
    """The tokens ``matcher`` accepted natively (stop tokens excluded)."""
    return list(matcher.history)


def check_walk(grammar: Any, matcher: Any, rng: np.random.Generator, size: int) -> list[str]:
    """Grow a tree at ``matcher``'s state, walk it natively, compare with the oracle."""
    prefix = history_of(matcher)
    body = sample_instance(matcher.fork(), rng, max_tokens=20)
    tree = grow_tree(grammar.matcher, prefix, body, size, rng)
    out = bm.allocate(tree.num_nodes, matcher.vocab_size, fill=-1)
    masks = fill_tree_bitmask(matcher, tree, out, budget=None)
    assert matcher.shadow is not None  # the native walk ran
    return compare(masks, out, tree, replay_tree(grammar.matcher, prefix, tree))


def test_twin_follows_accepts_rollbacks_resets_and_forks(toy_tokenizer_padded: Any) -> None:
    grammar = native_grammar(toy_tokenizer_padded)
    rng = np.random.default_rng(5)
    stops = set(toy_tokenizer_padded.stop_token_ids)
    matcher = grammar.matcher()
    problems: list[str] = []
    for step in range(40):
        problems += check_walk(grammar, matcher, rng, int(rng.choice([4, 16, 48])))
        action = step % 5
        if action in (0, 1):  # decode a few tokens, as after an accepted path
            for token in sample_instance(matcher.fork(), rng, max_tokens=int(rng.integers(1, 5))):
                if token in stops:
                    break
                assert matcher.accept(token)
        elif action == 2 and matcher.history:  # roll back, maybe below the twin's last sync
            matcher.rollback(int(rng.integers(1, len(matcher.history) + 1)))
        elif action == 3:  # a fork walks from its own twin; the original is untouched
            fork = matcher.fork()
            for token in sample_instance(fork.fork(), rng, max_tokens=3):
                if token in stops or not fork.accept(token):
                    break
            problems += check_walk(grammar, fork, rng, 16)
        elif step % 10 == 4:
            matcher.reset()
            assert matcher.shadow is None
    assert problems == []


def test_budget_prunes_inline_and_the_twin_survives(toy_tokenizer: Any) -> None:
    grammar = native_grammar(toy_tokenizer)
    rng = np.random.default_rng(9)
    matcher = grammar.matcher()
    body = sample_instance(matcher.fork(), rng, max_tokens=24)
    tree = grow_tree(grammar.matcher, [], body, 200, rng)
    oracle = replay_tree(grammar.matcher, [], tree)
    out = bm.allocate(tree.num_nodes, matcher.vocab_size, fill=0)
    masks = fill_tree_bitmask(matcher, tree, out, budget=0.0)
    assert masks.budget_hit and not masks.abandoned  # inline: no helper, nothing left running
    assert masks.filled.tolist() == [True] + [False] * (tree.num_nodes - 1)
    assert compare(masks, out, tree, oracle) == []
    # a budget that stops the walk part way: every kept row exact, the rest pruned
    masks = fill_tree_bitmask(matcher, tree, out, budget=1e-4)
    assert compare(masks, out, tree, oracle) == []
    # and the twin is back at the root: a full walk afterwards is exact
    masks = fill_tree_bitmask(matcher, tree, out, budget=None)
    assert not masks.budget_hit and masks.filled.sum() > 1
    assert compare(masks, out, tree, oracle) == []


def test_step_reuse_root_row_with_the_native_walk(toy_tokenizer: Any) -> None:
    """A given root row is trusted (``ROOT_READY``); rollbacks before it still refresh the memo."""
    grammar = native_grammar(toy_tokenizer, GrammarSpec.regex(r'\[("ab"|"abc")(,"ab")*\]'))
    rng = np.random.default_rng(3)
    matcher = grammar.matcher()
    problems: list[str] = []
    for _ in range(12):
        tree = grow_tree(
            grammar.matcher, history_of(matcher), sample_instance(matcher.fork(), rng, 12), 24, rng
        )
        root = bm.allocate(1, matcher.vocab_size, fill=0)
        matcher.fill_bitmask(root, 0)
        out = bm.allocate(tree.num_nodes, matcher.vocab_size, fill=-1)
        masks = fill_tree_bitmask(matcher, tree, out, budget=None, root_row=root[0])
        problems += compare(masks, out, tree, replay_tree(grammar.matcher, matcher.history, tree))
        path = [int(t) for t in tree.tokens[1:4] if t not in toy_tokenizer.stop_token_ids]
        accepted = 0
        for token in path:
            if not matcher.accept(token):
                break
            accepted += 1
        if accepted > 1:
            matcher.rollback(1)
    assert problems == []


def test_without_a_compiler_the_build_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setattr(build, "_built", {})
    monkeypatch.setattr(build, "_errors", {})
    monkeypatch.setattr(build, "cache_root", lambda: tmp_path)
    assert build.build_library("llg_walk.c") is None
    assert "no C compiler" in (build.last_error("llg_walk.c") or "")


def test_python_walk_takes_over_without_the_native_one(toy_tokenizer: Any) -> None:
    backend = get_backend("llguidance", toy_tokenizer, BackendOptions(llguidance_native_walk=False))
    assert backend.tree_walk().startswith("python")  # type: ignore[attr-defined]
    grammar = backend.compile(SCHEMA)
    rng = np.random.default_rng(2)
    matcher = grammar.matcher()
    tree = grow_tree(grammar.matcher, [], sample_instance(matcher.fork(), rng, 16), 32, rng)
    out = bm.allocate(tree.num_nodes, matcher.vocab_size, fill=0)
    masks = fill_tree_bitmask(matcher, tree, out, budget=None)
    assert matcher.shadow is None
    assert compare(masks, out, tree, replay_tree(grammar.matcher, [], tree)) == []
    if build.find_compiler() is not None:
        assert get_backend("llguidance", toy_tokenizer).tree_walk(60) == "native"  # type: ignore[attr-defined]
