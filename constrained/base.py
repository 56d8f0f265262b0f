"""The two protocols of the grammar layer: a compiled grammar and a per-request matcher.

A backend (``constrained/backends/<name>/``) compiles a :class:`GrammarSpec` against a
:class:`~espalier.constrained.tokenizer.TokenizerInfo` into a :class:`CompiledGrammar`; each request
gets its own :class:`GrammarMatcher` from it. Bitmask rows follow ``constrained/bitmask.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from espalier.constrained.errors import KeywordIssue
from espalier.constrained.spec import GrammarKind, GrammarSpec

if TYPE_CHECKING:
    import numpy as np

    from espalier.constrained.tree import DraftTree
    from espalier.constrained.tree.masks import TreeMasks


@runtime_checkable
class GrammarMatcher(Protocol):
    """Per-request grammar state. Not thread-safe; one thread drives it at a time.

    Token ids ``>= tokenizer vocab`` (model padding) are never accepted nor allowed.
    """

    @property
    def vocab_size(self) -> int:
        """Model vocabulary size V: bitmask rows have ``ceil(V/32)`` words."""
        ...

    def accept(self, token: int) -> bool:
        """Advance by one token. On ``False`` the state is exactly as before (never sticky)."""
        ...

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        """Accept ``tokens`` in order up to the first rejected one; returns how many were
        accepted (as many ``accept`` calls would, in one call where the backend can)."""
        ...

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        ...

    @property
    def exact_rollback(self) -> bool:
        """Masks after any ``rollback`` are exact. False (llguidance 1.9.1): a mask computed
        below the rolled-back point can leak into later ones, so callers that probe ahead
        should probe on a :meth:`fork`."""
        ...

    def prepare(self, scratch: torch.Tensor) -> None:
        """Make now what this matcher's first engine step would otherwise make on the engine
        thread: its current state's row (written into ``scratch[0]``, an int32 CPU row of
        ``ceil(V/32)`` words; its content is then undefined). The state does not change.
        Called where the matcher is made (the grammar service's threads), so a burst's first
        step does not compute that row for every request."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        """Write the allowed next tokens into row ``index`` of ``bitmask`` (int32, CPU, contiguous).

        When the grammar is terminated, only the stop tokens are allowed.
        """
        ...

    def is_terminated(self) -> bool:
        """A stop token was accepted (or the grammar admits nothing more)."""
        ...

    def can_terminate(self) -> bool:
        """The text so far is a complete match: a stop token would be accepted now."""
        ...

    def completes(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` would make the text a complete match (``accept_tokens`` takes
        them all, then ``can_terminate``); this matcher's state does not change."""
        ...

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` :meth:`accept_tokens` would accept (up to the first one it
        would reject); this matcher's state does not change. A check without a :meth:`fork`
        where the backend can (closing-path searches probe candidates with it)."""
        ...

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here (canonical tokens); may be []."""
        ...

    def fork(self) -> GrammarMatcher:
        """An independent copy with the same state (and its own rollback history)."""
        ...

    def fill_tree(
        self,
        tree: DraftTree,
        out: torch.Tensor | np.ndarray,
        *,
        budget: float | None,
        root_row: torch.Tensor | np.ndarray | None = None,
        threads: int = 1,
    ) -> TreeMasks:
        """Fill rows ``0..n-1`` of ``out`` (int32 ``[>= n, ceil(V/32)]``, C-contiguous, CPU)
        with the masks of ``tree``'s ``n`` nodes, one row per node, within ``budget`` seconds
        (None: no limit); the state after equals the state before. The node semantics are
        ``constrained/tree/masks.py``'s; each backend walks with its own library
        (``backends/<name>/tree_walk.py``). ``root_row``: the root's mask if already known;
        ``threads``: threads the walk may use (only llguidance's native walk uses two)."""
        ...

    def reset(self) -> None:
        """Back to the start state."""
        ...

    @property
    def batch_kind(self) -> Callable[[int], BatchStep] | None:
        """The factory (given a native thread count) of the batch entry point of this matcher's
        library; matchers with the same factory are filled in one call
        (``constrained/batch.py``). None: filled one by one."""
        ...

    @property
    def tree_batch_kind(self) -> Callable[[int], TreeBatch] | None:
        """The factory (given a native thread count) of this matcher's library's entry point
        for a step's draft trees (``engine/spec/masks.py``): the trees it takes are filled in
        one call of it. None: ``fill_tree`` one by one."""
        ...

    def native_closing(self, token: int | None, limit: int, keys: int = 0) -> NativeClosing | None:
        """A closing-path search (``engine/closing``'s ``ClosingPaths.search``, choice for
        choice) from this matcher's state after ``token`` (None: from here), at most ``limit``
        tokens, that the backend runs natively (``NativeClosing.kind``); this matcher is not
        changed. ``keys``: a duplicate-key tracker's handle whose rules the search follows
        (``constrained/keys/``; the caller keeps it alive). None: no native search (the
        caller searches in Python)."""
        ...

    @property
    def row_filter(self) -> RowFilter | None:
        """None: this matcher's rows are its own fills. Else its rows are those of
        ``row_filter.source`` with ``row_filter`` applied after: a batch fills the source in its
        library's batch call, then filters all such rows in one call per ``filter_kind``
        (``constrained/batch.py``)."""
        ...


@dataclass(frozen=True)
class ClosingRules:
    """What a closing-path search tries, in order (``engine/closing``'s ``ClosingPaths``), for
    backends that run it natively: the candidate ids, the closers among them, the quote
    (None: not one token), all closer ids, whitespace-only ids, how often one token may repeat
    (REPEAT_LIMIT) and how many of the lowest allowed ids the fallback tries."""

    candidates: tuple[int, ...]
    closers_first: tuple[int, ...]
    quote: int | None
    closers: frozenset[int]
    blank: frozenset[int]
    repeat_limit: int
    lowest: int
    policy: ClosingPolicy


@dataclass(frozen=True)
class ClosingPolicy:
    """The constants of ``engine/closing``'s decisions, for backends that decide whole draft
    trees natively (``NativeClosing.trees``): SEARCH_LIMIT, MARGIN, GROWTH_PER_TOKEN and
    EVERY_TOKEN there."""

    search_limit: int
    margin: int
    growth_per_token: int
    every_token: int


@dataclass(frozen=True)
class ClosingTree:
    """One draft tree's closing decisions to make natively (``ahead.tree_decisions``'s inputs).

    tokens, parents: the tree (node 0 = the root, ``parents[i] < i``); filled: bool ``[n]``, the
    nodes to decide (None: all); stops: the request's stop ids (never checked); here: output
    length when the step starts; max_tokens, room: a check at output length ``h`` has budget
    ``min(max_tokens - h, room - h)``; known, next_check, unclosable: the request's memo."""

    tokens: Sequence[int]
    parents: Sequence[int]
    filled: Sequence[bool] | np.ndarray | None
    stops: frozenset[int]
    here: int
    max_tokens: int
    room: int
    known: tuple[int, list[int]] | None
    next_check: int
    unclosable: bool


NodeDecision = tuple["list[int] | None", "tuple[int, list[int]] | None", int, bool]
"""A node's decision made natively: the closing path to emit instead of its token (None: none)
and the memo after it as ``(known, next_check, unclosable)``."""


FALLBACK = object()
"""A native search that must be made in Python (it raises the library's error there)."""


class NativeClosing(Protocol):
    """One native closing-path search (``GrammarMatcher.native_closing``)."""

    @property
    def kind(self) -> Callable[[ClosingRules, Sequence[NativeClosing], int], list[object]]:
        """``kind(rules, searches, threads)``: the outcomes of ``searches`` (all of this kind),
        each a path, None (none within its limit), False (its token is rejected) or
        :data:`FALLBACK`, in one native call on up to ``threads`` threads."""
        ...

    @property
    def trees(
        self,
    ) -> Callable[
        [ClosingRules, Sequence[tuple[NativeClosing, ClosingTree]], int],
        list[list[NodeDecision | None] | object],
    ]:
        """``trees(rules, items, threads)``: each tree's decisions (one a node, None where a
        node is not decided) made from the state this search starts at (its token unused), or
        :data:`FALLBACK` (decide that tree in Python), in one native call on up to ``threads``
        threads."""
        ...


class RowFilter(Protocol):
    """Tokens removed from the rows that another matcher (:attr:`source`) fills, e.g. those
    completing a repeated JSON key (``constrained/keys/``)."""

    @property
    def source(self) -> GrammarMatcher:
        """The matcher whose rows are filtered (its state is the filter's)."""
        ...

    @property
    def filter_kind(self) -> Callable[[Sequence[Any], torch.Tensor, Sequence[int], int], None]:
        """``kind(filters, bitmask, rows, threads)``: filter ``bitmask[rows[j]]`` (int32, CPU,
        contiguous, filled from ``filters[j].source``) for all ``filters`` (of this kind, no
        two the same) in one native call on up to ``threads`` threads; raises when it fails."""
        ...

    def take_clean(self, tokens: Sequence[int]) -> int:
        """Advance the filter by the longest prefix of ``tokens`` it lets through (up to the
        first it refuses); how many. A batch accept (``constrained/batch.py``) then advances
        :attr:`source` by those in its library's batch call and ends with :meth:`settle`, so
        the two make ``accept_tokens(tokens)``."""
        ...

    def settle(self, tokens: Sequence[int], clean: int, taken: int) -> int:
        """After :meth:`take_clean` gave ``clean`` and :attr:`source` took ``taken`` of those
        (``taken <= clean``): the filter rolled back to the source's state, then the rest of
        ``tokens`` accepted as ``accept_tokens`` would; the total count ``accept_tokens(tokens)``
        returns."""
        ...

    def refusal(self) -> str | None:
        """Why the last token this filter refused could not have been avoided (a dead end:
        every token :attr:`source` allowed was one it refuses), for the request's error; None
        when it could have."""
        ...

    @property
    def native_tree_filter(self) -> tuple[int, int] | None:
        """``(function, state)`` for native callers that filter a draft tree's rows in their
        own call (a tree batch): the address of a C function of ``llg_walk.c``'s
        ``EspTreeFilterFn`` signature (the tree, its rows and the walk's flags, updated in
        place; the state ends as it began) and the state pointer it takes, valid while this
        object lives. None: no native form (such trees are filled one by one)."""
        ...


@dataclass(frozen=True)
class BatchTree:
    """One request's draft tree in a :class:`TreeBatch` call.

    index: the request's index in the step (fault keys); matcher: the matcher that walks it
    (a row filter's source); tree_filter: its ``native_tree_filter`` is applied to its rows
    after the walk, or None;
    tokens, parents: the tree (``parents[0] == -1``, siblings in index order); row: its first
    row of the step's bitmask; node: its first node in the step's flag planes.
    """

    index: int
    matcher: GrammarMatcher
    tree_filter: RowFilter | None
    tokens: Sequence[int]
    parents: Sequence[int]
    row: int
    node: int


class TreeBatch(Protocol):
    """One grammar library's entry point for a step's draft trees: one native call for all
    the trees it takes, the GIL released throughout. Made once per mask builder and library
    (``GrammarMatcher.tree_batch_kind``); one caller at a time."""

    def takes(self, matcher: GrammarMatcher, parents: Sequence[int]) -> bool:
        """Whether :meth:`fill_trees` can fill ``matcher``'s tree of these ``parents`` now
        (else its ``fill_tree`` does)."""
        ...

    def fill_trees(
        self,
        trees: Sequence[BatchTree],
        rows: np.ndarray,
        flags: np.ndarray,
        budget: float | None,
        tree_threads: int,
        faults: dict[int, BaseException],
        seconds: dict[int, float] | None = None,
    ) -> float:
        """Fill every tree (each ``takes``) as ``fill_tree`` would, then apply its filter:
        rows int32 ``[R, ceil(V/32)]`` C-contiguous CPU; flags uint8 ``[3, M]`` (valid, filled,
        terminated), zero where the trees go, written in place. ``budget``: seconds per tree
        from its start (None: none); ``tree_threads``: threads one tree may use. A tree that
        fails gets ``faults[tree.index]`` (its rows then undefined); ``seconds`` (when given)
        gets each tree's own fill time by ``tree.index``. Returns the fills' seconds summed
        over the trees."""
        ...


class BatchStep(Protocol):
    """One grammar library's batch entry point for many of its matchers at once: one native
    call on the library's own thread pool with the GIL released. Made once per engine and
    library (``GrammarMatcher.batch_kind``); one caller at a time."""

    def fill_next_rows(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
        faults: dict[int, BaseException],
    ) -> None:
        """Fill ``bitmask[rows[j]]`` (int32, CPU, contiguous, ``[B, ceil(V/32)]``) from
        ``matchers[j]`` (this library's, none terminated) exactly as ``fill_bitmask`` would;
        states unchanged. A matcher that fails gets its exception in ``faults[j]`` (its row is
        then undefined); raises when the call fails as a whole without saying which did."""
        ...

    def accept_runs(
        self,
        matchers: Sequence[GrammarMatcher],
        runs: Sequence[Sequence[int]],
        accepted: list[int],
        faults: dict[int, BaseException],
    ) -> None:
        """Advance ``matchers[j]`` (this library's) by ``runs[j]`` exactly as
        ``matchers[j].accept_tokens(runs[j])`` would, setting ``accepted[j]`` to the count it
        would return. A matcher that raises gets its exception in ``faults[j]`` (its state is
        then undefined); never raises as a whole."""
        ...


@runtime_checkable
class CompiledGrammar(Protocol):
    """A grammar compiled for one tokenizer; immutable and shared between requests and threads."""

    @property
    def backend(self) -> str: ...

    @property
    def spec(self) -> GrammarSpec: ...

    @property
    def memory_bytes(self) -> int:
        """Approximate resident size, for the byte-bounded compile cache."""
        ...

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start state."""
        ...


@runtime_checkable
class GrammarBackend(Protocol):
    """A grammar library bound to one tokenizer."""

    name: str
    kinds: frozenset[GrammarKind]

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile; raises InvalidGrammarError / UnsupportedGrammarError."""
        ...


@dataclass(frozen=True)
class CompileReport:
    """What the caller learns from compiling: the backend chosen and what it does not enforce.

    ``compile_seconds``: the chosen backend's run time; ``queue_seconds``: time the compile waited
    (in a compile cache's queue and for a place to run) before and while it ran, 0 on a hit."""

    backend: str
    weakened: tuple[KeywordIssue, ...] = ()
    compile_seconds: float = 0.0
    queue_seconds: float = 0.0
    cache_hit: bool = False
    cache_key: str = ""
    notes: tuple[str, ...] = field(default=())
