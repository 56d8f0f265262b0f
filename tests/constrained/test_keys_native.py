"""The native key tracker (``constrained/keys/keys.c``) against its Python twin
(``tests/fixtures/keys_twin.py``): states, rollback, forks, row filters, batch row filters and
tree filters on random token sequences (keys, escapes, ``\\u`` surrogates, nested objects and
arrays), over a toy vocabulary and Gemma's 262,144 ids. Every comparison must match exactly.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.keys.native import KeyTables, KeyTracker, filter_rows
from espalier.constrained.tree import DraftTree
from tests.fixtures.keys_twin import (
    START,
    KeyState,
    filter_row,
    filter_tree,
    parse_export,
    step,
    tree_case,
)
from tests.fixtures.tree_random import tree_from_paths

# pieces JSON-ish texts are made of: keys that repeat, escapes (\\", \\\\, \\u0061 = "a", a
# surrogate pair and its halves, a bad \\u), containers, separators, strings with quotes in them
PIECES = [
    '{', '}', '[', ']', ',', ':', ' ', '"', '"a"', '"b"', '"ab"', 'a', 'b', '\\"', '\\\\',
    '\\u0061', '\\ud83d', '\\ude00', '\\ud83d\\ude00', '\U0001f600', '\\u00e9', 'é', '\\uzz12',
    '\\n', '\\u0000', '", "', '": ', '", "a', '{"a', '"}', '1', 'null', '\\u', '\\ud8',
]  # fmt: skip


KEYS = ["a", "b", "ab", r"\u0061", r"\ud83d\ude00", "\U0001f600", r"\"", "a\\\\", "é", r"\u00e9"]


def _random_text(rng: random.Random, length: int) -> str:
    """Pieces, or (mostly) objects whose keys come from a few that repeat, nested."""
    if rng.random() < 0.3:
        return "".join(rng.choice(PIECES) for _ in range(length))
    return _value(rng, 3, 0.0) + "".join(rng.choice(PIECES) for _ in range(rng.randrange(3)))


def _value(rng: random.Random, depth: int, roll: float | None = None) -> str:
    roll = rng.random() if roll is None else roll
    if depth and roll < 0.5:
        pairs = [f'"{rng.choice(KEYS)}": {_value(rng, depth - 1)}' for _ in range(rng.randrange(6))]
        return "{" + ", ".join(pairs) + "}"
    if depth and roll < 0.65:
        return "[" + ", ".join(_value(rng, depth - 1) for _ in range(rng.randrange(3))) + "]"
    return rng.choice(['"a"', "1", r'"x\"y"', "null", r'"\ud83d"'])


def _twin_walk(token_bytes: list[bytes], tokens: list[int]) -> list[KeyState | None]:
    """The twin's state after each prefix (None from the first duplicate on)."""
    states: list[KeyState | None] = [START]
    for token in tokens:
        prev = states[-1]
        data = token_bytes[token] if token < len(token_bytes) else b""
        states.append(step(prev, data) if prev is not None else None)
    return states


def _tokens(tokenizer: Any, rng: random.Random) -> list[int]:
    """A random JSON-ish text (cut anywhere, inside keys too) and a key start, as tokens, with
    random single tokens (quotes, braces) mixed in."""
    text = _random_text(rng, rng.randrange(4, 40))
    text = text[: rng.randrange(len(text) + 1)] + rng.choice(["", ', "', ', "a', ', "\\u00'])
    tokens = tokenizer.encode(text)
    quoted = _quote_tokens(tokenizer)
    for _ in range(rng.choice([0, 0, 0, 1, 3])):
        tokens.insert(rng.randrange(len(tokens) + 1), rng.choice(quoted))
    return tokens


_QUOTED: dict[int, list[int]] = {}


def _quote_tokens(tokenizer: Any) -> list[int]:
    key = id(tokenizer)
    if key not in _QUOTED:
        tb = tokenizer.token_bytes
        _QUOTED[key] = [t for t, b in enumerate(tb) if any(c in b for c in b'"{}[],\\')]
    return _QUOTED[key]


def _tracker(tokenizer: Any) -> KeyTracker:
    return KeyTracker(
        tokenizer.backend_view("test_keys_native", lambda t: KeyTables(t.token_bytes))
    )


def _check_states(tokenizer: Any, seed: int, walks: int) -> int:
    """Accept (strict), compare with the twin after every token, then roll back and fork;
    ``clean_prefix`` counts what ``accept_tokens`` would take and leaves the state; returns how
    many duplicates were met."""
    rng = random.Random(seed)
    tb = tokenizer.token_bytes
    met = 0
    for _ in range(walks):
        tokens = _tokens(tokenizer, rng)
        expected = _twin_walk(tb, tokens)
        tracker = _tracker(tokenizer)
        clean = next((i for i, state in enumerate(expected[1:]) if state is None), len(tokens))
        assert tracker.clean_prefix(tokens) == clean
        assert tracker.accepted == 0 and parse_export(tracker.export()) == expected[0]
        accepted = 0
        for i, token in enumerate(tokens):
            ok = tracker.accept(token)
            assert ok == (expected[i + 1] is not None), (tokens[: i + 1], expected[i])
            if not ok:
                met += 1
                assert parse_export(tracker.export()) == expected[i]  # unchanged
                break
            accepted += 1
            assert parse_export(tracker.export()) == expected[i + 1]
        assert tracker.accepted == accepted
        back = rng.randrange(accepted + 1)
        fork = tracker.fork()
        tracker.rollback(back)
        assert parse_export(tracker.export()) == expected[accepted - back]
        assert parse_export(fork.export()) == expected[accepted]  # forks are independent
        assert tracker.clean_prefix(tokens[accepted - back :]) == back
        assert parse_export(tracker.export()) == expected[accepted - back]
        again = tracker.accept_tokens(tokens[accepted - back :])
        assert again == back
        assert parse_export(tracker.export()) == expected[accepted]
    return met


def test_states_equal_the_twin_on_the_toy_vocabulary(toy_tokenizer: Any) -> None:
    assert _check_states(toy_tokenizer, seed=1, walks=400) > 10


@pytest.mark.model
def test_states_equal_the_twin_on_gemma(gemma_tokenizer: Any) -> None:
    assert _check_states(gemma_tokenizer, seed=2, walks=300) > 10


def test_a_repeated_key_is_refused_strict_or_not(toy_tokenizer: Any) -> None:
    """Loose accepts let a needless escape through, never a duplicate key: the refusal says it
    was a key."""
    tracker = _tracker(toy_tokenizer)
    tokens = toy_tokenizer.encode('{"a": 1, "a')
    assert tracker.accept_tokens(tokens) == len(tokens)
    quote = toy_tokenizer.encode('"')[0]
    assert not tracker.accept(quote)
    assert not tracker.accept(quote, strict=False)
    assert tracker.refused_key
    state = parse_export(tracker.export())
    assert state.key == b"a" and state.stack == ((frozenset({b"a"}), True),)


def _random_row(rng: random.Random, words: int, quoted: list[int]) -> np.ndarray:
    """A row allowing some quote-holding tokens (sparse, dense or all) and some others."""
    kind = rng.random()
    if kind < 0.2:
        return np.full(words, -1, dtype=np.int32)
    row = np.zeros(words, dtype=np.int32).view(np.uint32)
    size = len(quoted) if kind < 0.5 else rng.choice([1, 3, 30, 300])
    chosen = rng.sample(quoted, min(len(quoted), size))
    for t in chosen + ([] if kind < 0.4 else [rng.randrange(words * 32)]):
        row[t >> 5] |= np.uint32(1 << (t & 31))
    return row.view(np.int32)


def _check_rows(tokenizer: Any, seed: int, walks: int) -> int:
    """Row filters and one batch filter call against the twin at random states."""
    rng = random.Random(seed)
    tb = tokenizer.token_bytes
    words = bm.words_per_row(tokenizer.vocab_size)
    quoted = [t for t, b in enumerate(tb) if b'"' in b]
    trackers, states, rows, changed = [], [], [], 0
    for _ in range(walks):
        tokens = _tokens(tokenizer, rng)
        expected = _twin_walk(tb, tokens)
        tracker = _tracker(tokenizer)
        done = tracker.accept_tokens(tokens)
        cut = done if rng.random() < 0.5 else rng.randrange(done + 1)  # done: before a duplicate
        tracker.rollback(done - cut)
        state = expected[cut]
        assert state is not None
        row = _random_row(rng, words, quoted)
        mine, theirs = row.copy(), row.copy()
        assert tracker.filter_row(mine) == filter_row(state, theirs, tb)
        assert np.array_equal(mine, theirs)
        changed += not np.array_equal(mine, row)
        trackers.append(tracker)
        states.append(state)
        rows.append(row)
    # the batch call: every row at once, rows in shuffled places of one bitmask, two threads
    place = list(range(len(rows)))
    rng.shuffle(place)
    bitmask = np.zeros((len(rows), words), dtype=np.int32)
    for j, row in enumerate(rows):
        bitmask[place[j]] = row
    results = filter_rows(trackers, bitmask, place, threads=2)
    for j, row in enumerate(rows):
        theirs = row.copy()
        assert results[j] == filter_row(states[j], theirs, tb)
        assert np.array_equal(bitmask[place[j]], theirs)
    return changed


def test_row_filters_equal_the_twin_on_the_toy_vocabulary(toy_tokenizer: Any) -> None:
    assert _check_rows(toy_tokenizer, seed=3, walks=300) > 10


@pytest.mark.model
def test_row_filters_equal_the_twin_on_gemma(gemma_tokenizer: Any) -> None:
    assert _check_rows(gemma_tokenizer, seed=4, walks=120) > 10


def _random_tree(tokenizer: Any, rng: random.Random, root: int) -> DraftTree:
    texts = [_random_text(rng, rng.randrange(1, 6)) for _ in range(rng.randrange(1, 5))]
    paths = [tokenizer.encode(t)[:8] for t in texts]
    return tree_from_paths(root, [p for p in paths if p])


def _check_trees(tokenizer: Any, seed: int, trees: int) -> int:
    """Tree filters against the twin: random trees from random states, rows allowing every
    token or random ones, random walk flags (a valid node's subtree may be invalid, rows
    unfilled)."""
    rng = random.Random(seed)
    tb = tokenizer.token_bytes
    words = bm.words_per_row(tokenizer.vocab_size)
    quoted = [t for t, b in enumerate(tb) if b'"' in b]
    cut_nodes = 0
    for _ in range(trees):
        tokens = _tokens(tokenizer, rng)
        expected = _twin_walk(tb, tokens)
        tracker = _tracker(tokenizer)
        done = tracker.accept_tokens(tokens)
        state = expected[done]
        assert state is not None
        tree = _random_tree(tokenizer, rng, tokens[done - 1] if done else 0)
        n = tree.num_nodes
        rows = np.stack([_random_row(rng, words, quoted) for _ in range(n)])
        rows, flags = tree_case(rng, tree.parents.tolist(), tree.tokens.tolist(), rows)
        mine_rows, mine_flags = rows.copy(), tuple(f.copy() for f in flags)
        twin_rows, twin_flags = rows.copy(), tuple(f.copy() for f in flags)
        before = tracker.export()
        tracker.filter_tree(tree.tokens, tree.first_child, tree.next_sibling, mine_rows, mine_flags)
        assert tracker.export() == before
        filter_tree(state, tree.tokens.tolist(), tree.parents.tolist(), twin_rows, twin_flags, tb)
        assert np.array_equal(mine_rows, twin_rows)
        for mine, theirs in zip(mine_flags, twin_flags, strict=True):
            assert np.array_equal(mine, theirs)
        cut_nodes += int(flags[0].sum() - mine_flags[0].sum())
    return cut_nodes


def test_tree_filters_equal_the_twin_on_the_toy_vocabulary(toy_tokenizer: Any) -> None:
    assert _check_trees(toy_tokenizer, seed=5, trees=300) > 10


@pytest.mark.model
def test_tree_filters_equal_the_twin_on_gemma(gemma_tokenizer: Any) -> None:
    assert _check_trees(gemma_tokenizer, seed=6, trees=120) > 10
