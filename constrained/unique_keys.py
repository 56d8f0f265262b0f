"""A :class:`GrammarMatcher` whose JSON objects never repeat a key: a backend's matcher plus the
key tracker of ``constrained/json_keys.py``.

:func:`with_unique_keys` wraps a request's matcher when its grammar can hold objects with free
keys (:func:`~espalier.constrained.json_keys.may_repeat_keys`); other matchers are returned as
they are. Rows are the backend's rows minus the tokens that would complete a key already in its
object; ``accept`` rejects exactly those tokens; a draft tree's rows are the backend's walk
(its native fast path) filtered the same way node by node (:meth:`UniqueKeysMatcher.fill_tree`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.json_keys import START, KeyState, KeyTables, may_repeat_keys, step

if TYPE_CHECKING:
    from espalier.constrained.base import BatchStep, GrammarMatcher
    from espalier.constrained.spec import GrammarSpec
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.constrained.tree import DraftTree
    from espalier.constrained.tree.masks import TreeMasks


def with_unique_keys(
    spec: GrammarSpec, matcher: GrammarMatcher, tokenizer: TokenizerInfo
) -> GrammarMatcher:
    """``matcher`` itself, or wrapped so that no object of its output repeats a key."""
    if not may_repeat_keys(spec):
        return matcher
    tables: KeyTables = tokenizer.backend_view("espalier.constrained.json_keys", KeyTables.build)
    return UniqueKeysMatcher(matcher, tables, tokenizer)


class UniqueKeysMatcher:
    """``inner`` (any matcher) with duplicate-key completions removed (module docstring).

    ``history``: the lexer state after each accepted token, the start state first (rollback
    pops them)."""

    def __init__(
        self,
        inner: GrammarMatcher,
        tables: KeyTables,
        tokenizer: TokenizerInfo,
        history: list[KeyState] | None = None,
    ) -> None:
        self.inner = inner
        self.tables = tables
        self.tokenizer = tokenizer
        self.history = history if history is not None else [START]
        self._row: torch.Tensor | None = None  # scratch row of the dead-end check, made on use

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def exact_rollback(self) -> bool:
        return self.inner.exact_rollback

    @property
    def batch_kind(self) -> Callable[[int], BatchStep] | None:
        """None: ``constrained/batch.py`` fills ``inner`` in its library's batch call and then
        this wrapper's ``filter_row``."""
        return None

    def accept(self, token: int) -> bool:
        after = self._after(token)
        if after is None or not self.inner.accept(token):
            return False
        self.history.append(after)
        return True

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        done = 0
        while done < len(tokens):
            states: list[KeyState] = []
            state = self.history[-1]
            for token in tokens[done:]:
                nxt = step(state, self._bytes(token))
                if nxt is None:
                    break
                states.append(nxt)
                state = nxt
            taken = self.inner.accept_tokens(tokens[done : done + len(states)]) if states else 0
            self.history.extend(states[:taken])
            done += taken
            if taken < len(states) or done == len(tokens) or not self.accept(tokens[done]):
                break  # rejected by the grammar, or a duplicate the dead-end rule refuses
            done += 1
        return done

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        self.inner.rollback(n)
        del self.history[-n:]

    def fill_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        self.inner.fill_bitmask(bitmask, index)
        self.filter_row(bitmask[index])

    def filter_row(self, row: torch.Tensor) -> None:
        """Remove the duplicate completions from ``row`` (int32 ``[W]``, CPU), a row the inner
        matcher filled at the current state (``constrained/batch.py`` fills inner matchers
        in one native call, then each wrapper filters its row)."""
        self._filter(row.numpy(), self.history[-1])

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def can_terminate(self) -> bool:
        return self.inner.can_terminate()

    def forced_tokens(self, limit: int) -> list[int]:
        forced = self.inner.forced_tokens(limit)
        state: KeyState | None = self.history[-1]
        for i, token in enumerate(forced):
            state = step(state, self._bytes(token)) if state is not None else None
            if state is None:
                return forced[:i]
        return forced

    def fork(self) -> UniqueKeysMatcher:
        return UniqueKeysMatcher(self.inner.fork(), self.tables, self.tokenizer, [*self.history])

    def reset(self) -> None:
        self.inner.reset()
        self.history = [START]

    def fill_tree(
        self,
        tree: DraftTree,
        out: torch.Tensor | np.ndarray,
        *,
        budget: float | None,
        root_row: torch.Tensor | np.ndarray | None = None,
        threads: int = 1,
    ) -> TreeMasks:
        """The backend matcher's own walk (``inner.fill_tree``), then each node filtered in
        order: a node whose token the filtered parent row forbids is invalid with its subtree;
        a filled row loses its duplicate completions."""
        masks = self.inner.fill_tree(tree, out, budget=budget, root_row=root_row, threads=threads)
        rows = out.numpy() if isinstance(out, torch.Tensor) else out
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        states: list[KeyState | None] = [self.history[-1]] + [None] * (len(tokens) - 1)
        if masks.filled[0]:
            self._filter(rows[0], self.history[-1])
        for node in range(1, len(tokens)):
            parent_state = states[parents[node]]
            if not masks.valid[node]:
                continue
            token = tokens[node]
            after = step(parent_state, self._bytes(token)) if parent_state is not None else None
            if after is None or not _has(rows[parents[node]], token):
                masks.valid[node] = masks.filled[node] = masks.terminated[node] = False
                rows[node] = rows[parents[node]]  # no row is all-zero; never used
                continue
            states[node] = after
            if masks.filled[node]:
                self._filter(rows[node], after)
        return masks

    # -- the filter ---------------------------------------------------------------------------

    def _after(self, token: int) -> KeyState | None:
        """The lexer state after ``token``; None when it completes a duplicate and some other
        token is allowed (the dead-end rule: a row is never emptied)."""
        state = self.history[-1]
        after = step(state, self._bytes(token))
        if after is not None:
            return after
        row = self._row
        if row is None:
            row = self._row = bm.allocate(1, self.inner.vocab_size, fill=0)
        self.inner.fill_bitmask(row, 0)
        if self._filter(row[0].numpy(), state):
            return None
        return step(state, self._bytes(token), strict=False)

    def _filter(self, row: np.ndarray, state: KeyState) -> bool:
        """Clear the duplicate completions from ``row`` (int32 ``[W]``) unless that would
        empty it; True when cleared (or none were allowed)."""
        found = self.tables.duplicates(state, row)
        if not found:
            return True
        ids = np.array(found, dtype=np.int64)
        saved = row.copy()
        np.bitwise_and.at(row, ids >> 5, ~(np.int64(1) << (ids & 31)).astype(np.int32))
        if row.any():
            return True
        row[:] = saved
        return False

    def _bytes(self, token: int) -> bytes:
        data = self.tables.token_bytes
        return data[token] if token < len(data) else b""


def _has(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)
