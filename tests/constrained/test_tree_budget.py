"""The budget as a wall-clock bound (``constrained.tree.bounded``): a fill that is stuck in one
slow native call is abandoned at the deadline, and what comes back is still exact.

A "slow native call" is simulated by a proxy around the fork's native matcher that blocks on an
event at its k-th mask computation; the event is released only after ``fill_tree_bitmask`` has
returned, so the abandoned walk finishes late, as a real slow fill would. Only xgrammar's walks
go to a helper: llguidance's native walk checks the budget in C, inline
(``test_llguidance_native.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.tree.bounded import LATENCY, start_row_fill
from espalier.constrained.tree.masks import fill_tree_bitmask
from tests.constrained.test_tree_masks import REGEX, drawn_tree, state_snapshot
from tests.constrained.test_tree_masks import compiled as compiled_any
from tests.fixtures.tree_oracle import compare, replay_tree

SLOW_CALLS = {"xgrammar": "fill_next_token_bitmask"}
HELPED = list(SLOW_CALLS)
"""The backends whose budgeted walks run on a helper thread."""


def compiled(name: str, tokenizer: Any, spec: GrammarSpec) -> Any:
    """``spec`` compiled by ``name``."""
    return compiled_any(name, tokenizer, spec)


class SlowNative:
    """Delegates to ``inner``; once ``armed``, its ``stall_at``-th call of ``method`` waits for
    ``release``. Copies (``deep_copy``) are proxies too and count their calls on the original,
    so the k-th call is the k-th of the whole walk."""

    def __init__(self, inner: Any, method: str, stall_at: int, release: threading.Event) -> None:
        self._inner, self._method, self._stall_at = inner, method, stall_at
        self._release = release
        self._origin = self
        self.armed = False
        self.calls = 0
        self.finished = threading.Event()

    def deep_copy(self) -> SlowNative:
        other = SlowNative(self._inner.deep_copy(), self._method, self._stall_at, self._release)
        other._origin = self._origin
        return other

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        origin = self._origin
        if name != self._method or not origin.armed:
            return attr

        def call(*args: Any) -> Any:
            origin.calls += 1
            stall = origin.calls == self._stall_at
            if stall:
                self._release.wait(10.0)
            value = attr(*args)
            if stall:
                origin.finished.set()
            return value

        return call


def stalling_matcher(grammar: Any, method: str, stall_at: int) -> tuple[Any, Any, threading.Event]:
    """A matcher whose native matcher stalls at its ``stall_at``-th ``method`` call once armed."""
    release = threading.Event()
    matcher = grammar.matcher()
    matcher.native = SlowNative(matcher.native, method, stall_at, release)
    return matcher, matcher.native, release


@pytest.mark.parametrize(
    ("backend", "stall_at"),
    # the k-th fill of the walk (1 = the root)
    [(b, k) for b in HELPED for k in (1, 2, 4)],
)
def test_slow_fill_is_abandoned_at_the_deadline_and_stays_exact(
    backend: str, stall_at: int, toy_tokenizer: Any
) -> None:
    grammar = compiled(backend, toy_tokenizer, GrammarSpec.regex(REGEX))
    tree, _ = drawn_tree(toy_tokenizer)
    matcher, proxy, release = stalling_matcher(grammar, SLOW_CALLS[backend], stall_at)
    before = state_snapshot(matcher)
    out = bm.allocate(tree.num_nodes, toy_tokenizer.vocab_size, fill=0)
    budget = 0.05
    proxy.armed = True
    recorded = LATENCY.recorded
    masks = fill_tree_bitmask(matcher, tree, out, budget=budget)
    # returned while the stalled call still blocks (it waits for ``release``, set only below):
    # the walk gave up at the deadline instead of waiting for the fill; no clock is read here
    assert not proxy.finished.is_set()
    assert LATENCY.recorded == recorded + 1  # the give-up latency feeds the learnt margin
    returned = out.numpy().copy()
    assert masks.writes_pending()  # the stalled fill is still in flight
    release.set()  # the abandoned walk now finishes, late
    assert proxy.finished.wait(10.0)
    assert masks.wait_late_writes(10.0) and not masks.writes_pending()
    assert matcher.native is not proxy  # the caller got a copy at its state before the call
    assert masks.budget_hit and masks.abandoned
    assert masks.filled[0] and masks.valid[0]
    assert masks.filled.sum() < tree.num_nodes
    oracle = replay_tree(grammar.matcher, [], tree)
    assert compare(masks, returned, tree, oracle) == []  # exact when returned
    # late writes touch only pruned rows: the root and every kept row are as returned
    assert np.array_equal(out.numpy()[masks.filled], returned[masks.filled])
    assert state_snapshot(matcher) == before


@pytest.mark.parametrize("backend", HELPED)
def test_budgeted_walk_on_a_helper_is_exact_and_complete(backend: str, toy_tokenizer: Any) -> None:
    grammar = compiled(backend, toy_tokenizer, GrammarSpec.regex(REGEX))
    tree, expected = drawn_tree(toy_tokenizer)
    matcher = grammar.matcher()
    assert matcher.accept(toy_tokenizer.hf.convert_tokens_to_ids("x"))
    before = state_snapshot(matcher)
    out = bm.allocate(tree.num_nodes, toy_tokenizer.vocab_size, fill=-1)
    masks = fill_tree_bitmask(matcher, tree, out, budget=10.0)
    assert not masks.budget_hit and not masks.abandoned
    oracle = replay_tree(grammar.matcher, [toy_tokenizer.hf.convert_tokens_to_ids("x")], tree)
    assert compare(masks, out, tree, oracle) == []
    assert state_snapshot(matcher) == before
    del expected


@pytest.mark.parametrize("backend", HELPED)
def test_root_row_given_and_abandoned_keeps_it(backend: str, toy_tokenizer: Any) -> None:
    """With step reuse the root row comes in; an abandoned walk must keep it, not recompute it."""
    grammar = compiled(backend, toy_tokenizer, GrammarSpec.regex(REGEX))
    tree, _ = drawn_tree(toy_tokenizer)
    method = SLOW_CALLS[backend]
    matcher, proxy, release = stalling_matcher(grammar, method, 1)
    root = bm.allocate(1, toy_tokenizer.vocab_size, fill=0)
    matcher.fill_bitmask(root, 0)
    out = bm.allocate(tree.num_nodes, toy_tokenizer.vocab_size, fill=0)
    proxy.armed = True
    masks = fill_tree_bitmask(matcher, tree, out, budget=0.02, root_row=root[0])
    returned = out.numpy().copy()
    release.set()
    assert proxy.finished.wait(10.0) and masks.wait_late_writes(10.0)
    assert masks.abandoned and masks.filled[0]
    assert np.array_equal(returned[0], root.numpy()[0])
    assert np.array_equal(out.numpy()[0], root.numpy()[0])
    assert compare(masks, out, tree, replay_tree(grammar.matcher, [], tree)) == []


def test_zero_budget_never_starts_a_helper(toy_tokenizer: Any) -> None:
    grammar = compiled("xgrammar", toy_tokenizer, GrammarSpec.regex(REGEX))
    tree, _ = drawn_tree(toy_tokenizer)
    matcher, proxy, release = stalling_matcher(grammar, SLOW_CALLS["xgrammar"], 2)
    out = bm.allocate(tree.num_nodes, toy_tokenizer.vocab_size, fill=0)
    proxy.armed = True
    masks = fill_tree_bitmask(matcher, tree, out, budget=0.0)
    release.set()
    assert masks.filled.tolist() == [True] + [False] * (tree.num_nodes - 1)
    assert proxy.calls == 1 and not masks.abandoned  # the caller's root fill, nothing else
    assert compare(masks, out, tree, replay_tree(grammar.matcher, [], tree)) == []


def test_engine_buffer_is_not_reused_while_a_late_write_is_pending() -> None:
    """``engine/spec/masks.py`` reuses one bitmask buffer per step; after an abandoned fill whose
    native call may still write it, that buffer is parked and another one used."""
    from espalier.constrained.tree.masks import TreeMasks
    from espalier.engine.spec.masks import MaskBuilder

    builder = MaskBuilder(64, threads=1)
    try:
        first = builder._rows(4)
        assert builder._rows(4).data_ptr() == first.data_ptr()  # reused
        late = threading.Event()
        flags = np.zeros(4, dtype=bool)
        builder._late.append(TreeMasks(flags, flags, flags, True, 0.0, True, late))
        second = builder._rows(4)
        assert second.data_ptr() != first.data_ptr()  # the first is parked for its late writer
        assert builder._rows(4).data_ptr() == second.data_ptr()
        late.set()  # the first's writer ended: it is the spare the next park picks up
        builder._late.append(TreeMasks(flags, flags, flags, True, 0.0, True, threading.Event()))
        assert builder._rows(4).data_ptr() == first.data_ptr()
    finally:
        builder.close()


def test_a_bounded_row_fill_in_time_is_the_matchers_row(toy_tokenizer: Any) -> None:
    grammar = compiled("xgrammar", toy_tokenizer, GrammarSpec.regex(REGEX))
    matcher = grammar.matcher()
    assert matcher.accept(toy_tokenizer.hf.convert_tokens_to_ids("x"))
    expected = bm.allocate(1, toy_tokenizer.vocab_size, fill=0)
    matcher.fill_bitmask(expected, 0)
    out = bm.allocate(3, toy_tokenizer.vocab_size, fill=0)
    seconds = start_row_fill(matcher, out[1:2]).result(10.0)
    assert seconds is not None and seconds >= 0.0
    assert np.array_equal(out.numpy()[1], expected.numpy()[0])
    assert not out.numpy()[[0, 2]].any()  # only its row


def test_a_bounded_row_fill_past_its_limit_is_abandoned_and_writes_nothing(
    toy_tokenizer: Any,
) -> None:
    """The fill is stuck in its native call; the caller returns None at the limit, and the
    row stays as it was, also once the abandoned fill ends (it wrote a private row)."""
    grammar = compiled("xgrammar", toy_tokenizer, GrammarSpec.regex(REGEX))
    matcher, proxy, release = stalling_matcher(grammar, SLOW_CALLS["xgrammar"], 1)
    out = bm.allocate(1, toy_tokenizer.vocab_size, fill=0x5A5A5A5A)
    proxy.armed = True
    assert start_row_fill(matcher, out).result(0.05) is None
    assert not proxy.finished.is_set()  # returned while the fill still blocks
    release.set()
    assert proxy.finished.wait(10.0)
    time.sleep(0.2)  # the helper's hand-over comes right after the native call returns
    assert (out.numpy() == 0x5A5A5A5A).all()


def test_a_bounded_row_fill_passes_on_the_fills_error(toy_tokenizer: Any) -> None:
    grammar = compiled("xgrammar", toy_tokenizer, GrammarSpec.regex(REGEX))
    matcher = grammar.matcher()
    out = bm.allocate(1, toy_tokenizer.vocab_size, fill=0)
    with pytest.raises((ValueError, RuntimeError, TypeError)):
        start_row_fill(matcher, out.view(torch.int64)).result(10.0)  # a row of the wrong dtype
