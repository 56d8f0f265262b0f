"""What every backend adapter shares: options, vocabulary facts, and the matcher wrapper.

:class:`MatcherBase` normalises the libraries to one contract (``constrained/base.py``):

- ids ``>= tokenizer vocab`` (model padding) and special non-stop tokens are rejected before the
  library sees them, and are never set in a mask;
- stop tokens never reach the library: one is accepted when the text so far is a complete match;
  then the matcher is terminated: the mask allows exactly the stop tokens, accepting another stop
  token is a no-op that still counts for ``rollback``, anything else is rejected;
- a rejected token leaves the state unchanged (each adapter checks before it commits).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.errors import GrammarError, InvalidGrammarError, UnsupportedGrammarError
from espalier.constrained.schema.number_bounds import (
    DEFAULT_BOUNDS,
    NumberBounds,
    bound_schema_numbers,
)
from espalier.constrained.spec import GrammarKind, GrammarSpec
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.masks import TreeMasks, fill_with
from espalier.constrained.tree.walk import Walker

if TYPE_CHECKING:
    from espalier.constrained.base import BatchStep, NativeClosing, RowFilter, TreeBatch
    from espalier.constrained.tokenizer import TokenizerInfo


class BackendUnavailableError(GrammarError):
    """The library a backend needs is not installed."""

    reason = "BACKEND_UNAVAILABLE"

    def __init__(self, name: str, package: str, cause: str) -> None:
        self.name = name
        self.package = package
        super().__init__(
            f"grammar backend '{name}' needs the Python package '{package}'"
            f" (pip install {package}): {cause}"
        )


@dataclass(frozen=True)
class BackendOptions:
    """Knobs passed through to the grammar libraries.

    Attributes:
        json_max_whitespace: most whitespace characters allowed between JSON tokens (keys, values,
            separators). Bounded so generation cannot spin on whitespace forever; 4 admits
            ``json.dumps`` output (one space) and ``indent=2`` one level deep while keeping the
            outlines-core DFA small (its compile time grows with the bound: 16 costs ~4x of 4 on
            Gemma). ``0`` means compact JSON only.
        max_threads: threads a library may use to compile one grammar.
        json_number_bounds: how far JSON numbers may go in generated output
            (``constrained/schema/number_bounds.py``): integers within +-(2**53 - 1), numbers below
            10**15 in magnitude with at most 6 fraction digits, unless the schema bounds them.
            Only the grammar is narrowed (outputs still validate under the caller's schema), so
            a greedy model cannot write digits until max_tokens. ``None``: the libraries' own
            unbounded number grammars.
        outlines_memory_limit: address-space cap in bytes of the child process that builds each
            outlines-core Index (``backends/outlines_core/index.py``): a build past it fails with
            ``CompileMemoryError``, and under a compile cache the child is killed at the
            deadline. ``0``: build in the calling process, unbounded and not interruptible.
        xgrammar_memory_limit: address-space cap in bytes of the child processes that compile
            xgrammar grammars (``backends/xgrammar/``); under a compile cache the child is
            killed at the deadline. ``0``: compile in the calling process, not interruptible.
        compile_slots: compiles of one backend that run at once (child processes for xgrammar
            and outlines-core, in-process compiles for llguidance); more wait, each up to its
            own deadline, so a slow backend cannot take the others' compile threads.
            outlines-core gets fewer children when the machine's available memory holds fewer
            children of ``outlines_memory_limit``.
    """

    json_max_whitespace: int = 4
    max_threads: int = 2
    json_number_bounds: NumberBounds | None = DEFAULT_BOUNDS
    outlines_memory_limit: int = 4 << 30
    xgrammar_memory_limit: int = 8 << 30
    compile_slots: int = 2

    def json_source(self, spec: GrammarSpec, backend: str) -> str:
        """The schema text ``backend`` compiles for a JSON_SCHEMA ``spec``: with the number
        bounds added as keywords (llguidance, xgrammar) when they are on."""
        assert spec.kind is GrammarKind.JSON_SCHEMA
        if self.json_number_bounds is None:
            return spec.source
        bounded = bound_schema_numbers(spec.schema, backend, self.json_number_bounds)
        return json.dumps(bounded, separators=(",", ":"), ensure_ascii=False)

    @property
    def whitespace_regex(self) -> str:
        """Regex of the whitespace allowed between JSON tokens."""
        if self.json_max_whitespace <= 0:
            return ""
        return rf"[\x20\x0A\x0D\x09]{{0,{self.json_max_whitespace}}}"


@dataclass(frozen=True)
class VocabFacts:
    """Per-tokenizer facts the adapters need, built once per tokenizer (see ``vocab_facts``).

    Attributes:
        token_bytes: raw bytes of every tokenizer id.
        excluded: special (control) ids that are not stop tokens: never matched nor allowed.
        stops: stop token ids.
        stop_row: int32 ``[ceil(V/32)]`` CPU row allowing exactly the stop tokens.
    """

    token_bytes: list[bytes]
    excluded: frozenset[int]
    stops: frozenset[int]
    stop_row: torch.Tensor


def vocab_facts(tokenizer: TokenizerInfo) -> VocabFacts:
    """The :class:`VocabFacts` of ``tokenizer``, cached on it."""
    return tokenizer.backend_view("espalier.vocab_facts", _build_vocab_facts)  # type: ignore[no-any-return]


def _build_vocab_facts(tokenizer: TokenizerInfo) -> VocabFacts:
    from espalier.constrained.token_bytes import special_token_ids

    stops = frozenset(tokenizer.stop_token_ids)
    excluded = frozenset(special_token_ids(tokenizer.hf) - stops)
    stop_row = torch.from_numpy(bm.row_from_tokens(sorted(stops), tokenizer.vocab_size).copy())
    return VocabFacts(tokenizer.token_bytes, excluded, stops, stop_row)


R = TypeVar("R")


class MatcherBase:
    """Shared half of every matcher; subclasses implement the ``_native_*`` hooks.

    Subclass hooks see only text tokens (below the tokenizer vocabulary, neither excluded nor stop
    ids) and are never called while terminated; the library's own state never holds a stop token.
    """

    tokenizer: TokenizerInfo
    native: Any
    exact_rollback: bool = True
    """See ``GrammarMatcher.exact_rollback``."""
    batch_kind: Callable[[int], BatchStep] | None = None
    """See ``GrammarMatcher.batch_kind``: None, filled one by one."""
    tree_batch_kind: Callable[[int], TreeBatch] | None = None
    """See ``GrammarMatcher.tree_batch_kind``: None, trees filled one by one."""
    row_filter: RowFilter | None = None
    """See ``GrammarMatcher.row_filter``: None, the rows are the library's."""

    def __init__(self, tokenizer: TokenizerInfo, facts: VocabFacts) -> None:
        self.tokenizer = tokenizer
        self._facts = facts
        self._tokenizer_vocab = tokenizer.tokenizer_vocab_size
        self._stop_depth = 0  # stop tokens accepted at the end; > 0 means terminated
        rem = tokenizer.vocab_size % bm.BITS_PER_WORD
        # the last word's bits past V: libraries leave them as they were (must end up 0)
        self._tail = (tokenizer.vocab_size // bm.BITS_PER_WORD, (1 << rem) - 1) if rem else None

    # -- hooks -----------------------------------------------------------------------------------

    def _native_accept(self, token: int) -> bool:
        raise NotImplementedError

    def _native_rollback(self, n: int) -> None:
        raise NotImplementedError

    def _native_fill(self, bitmask: torch.Tensor, index: int) -> None:
        raise NotImplementedError

    def _native_can_terminate(self) -> bool:
        raise NotImplementedError

    def _native_reset(self) -> None:
        raise NotImplementedError

    def _tree_walks(self, tree: DraftTree, threads: int) -> tuple[Walker, Walker | None]:
        """The backend's walk of ``tree`` and, where one of its fills can be slow, the walk to
        run on a helper thread under a budget (``tree/masks.py:fill_with``; None: inline)."""
        raise NotImplementedError

    # -- the protocol ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def accept(self, token: int) -> bool:
        if not 0 <= token < self._tokenizer_vocab or token in self._facts.excluded:
            return False
        if token in self._facts.stops:
            # stop tokens never reach the library (their native handling differs): a stop is
            # accepted when the text so far is complete, and after that as a no-op
            if self._stop_depth or self._native_can_terminate():
                self._stop_depth += 1
                return True
            return False
        if self._stop_depth:
            return False
        return self._native_accept(token)

    def takes_natively(self, token: int) -> bool:
        """Whether :meth:`accept` of ``token`` is the library's own accept alone (a text token,
        not terminated): a batch accept may then hand it to the library directly."""
        return self.takes_all_natively((token,))

    def takes_all_natively(self, tokens: Sequence[int]) -> bool:
        """:meth:`takes_natively` of every one of ``tokens`` (one pass: closing checks ask it
        for every try)."""
        facts = self._facts
        return (
            not self._stop_depth
            and (not tokens or (min(tokens) >= 0 and max(tokens) < self._tokenizer_vocab))
            and facts.excluded.isdisjoint(tokens)
            and facts.stops.isdisjoint(tokens)
        )

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        accepted = 0
        for token in tokens:
            if not self.accept(token):
                break
            accepted += 1
        return accepted

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        stops = min(n, self._stop_depth)
        self._stop_depth -= stops
        if n > stops:
            self._native_rollback(n - stops)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        if self._stop_depth:
            bitmask[index].copy_(self._facts.stop_row)
            return
        self._native_fill(bitmask, index)
        self.clear_tail(bitmask, index)

    def is_terminated(self) -> bool:
        return self._stop_depth > 0

    def can_terminate(self) -> bool:
        return self._stop_depth > 0 or self._native_can_terminate()

    def completes(self, tokens: Sequence[int]) -> bool:
        return self.probe(
            tokens, lambda probe, taken: taken == len(tokens) and probe.can_terminate()
        )

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        return self.probe(tokens, lambda probe, taken: taken)

    def probe(self, tokens: Sequence[int], then: Callable[[MatcherBase, int], R]) -> R:
        """``then(probe, taken)`` with ``probe`` advanced by the ``taken`` tokens of ``tokens``
        that :meth:`accept_tokens` would take; this matcher's state does not change. ``probe``
        is this matcher, rolled back after, where rollback is exact, else a fork: a fork copies
        the library's state (outlines-core's replays the whole history), and closing searches
        and forced chains probe many times a step."""
        probe = self if self.exact_rollback else self.fork()
        taken = 0
        try:
            for token in tokens:
                if not probe.accept(token):
                    break
                taken += 1
            return then(probe, taken)
        finally:
            if probe is self:
                self.rollback(taken)

    def fork(self) -> MatcherBase:
        raise NotImplementedError

    def prepare(self, scratch: torch.Tensor) -> None:
        """See ``GrammarMatcher.prepare``: the row (the library builds its start state)."""
        self.fill_bitmask(scratch, 0)

    def native_closing(self, token: int | None, limit: int, keys: int = 0) -> NativeClosing | None:
        """See ``GrammarMatcher.native_closing``: None, the caller searches in Python."""
        return None

    def fill_tree(
        self,
        tree: DraftTree,
        out: torch.Tensor | np.ndarray,
        *,
        budget: float | None,
        root_row: torch.Tensor | np.ndarray | None = None,
        threads: int = 1,
    ) -> TreeMasks:
        walk, bounded_walk = self._tree_walks(tree, threads)
        return fill_with(
            self,
            tree,
            out,
            budget=budget,
            root_row=root_row,
            walk=walk,
            bounded_walk=bounded_walk,
        )

    def reset(self) -> None:
        self._stop_depth = 0
        self._native_reset()

    def _copy_state_to(self, other: MatcherBase) -> None:
        other._stop_depth = self._stop_depth

    def clear_tail(self, bitmask: torch.Tensor, index: int) -> None:
        """Clear row ``index``'s bits past V, which the libraries leave as they were."""
        if self._tail is not None:
            word, keep = self._tail
            bitmask[index, word] &= keep


class CompiledBase:
    """Shared half of every compiled grammar."""

    native: Any

    def __init__(self, backend: str, spec: GrammarSpec, tokenizer: TokenizerInfo) -> None:
        self._backend = backend
        self._spec = spec
        self.tokenizer = tokenizer

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def spec(self) -> GrammarSpec:
        return self._spec


def canonical_forced_tokens(matcher: MatcherBase, forced: bytes, limit: int) -> list[int]:
    """Tokens of the forced text ``forced`` from ``matcher``'s state, at most ``limit``.

    The text is tokenized the tokenizer's own way (its canonical tokenization). The last token is
    kept only if nothing but a stop token can follow the forced text: otherwise later text might
    merge with it. The tokens are checked by :meth:`MatcherBase.probe` (``matcher`` itself where
    its rollback is exact); the chain stops at the first rejection. The tokenizer
    must reproduce ``forced`` exactly, else the result is ``[]``.
    """
    if limit <= 0 or not forced or matcher.is_terminated():
        return []
    tokenizer: TokenizerInfo = matcher.tokenizer
    longest = tokenizer.backend_view(_LONGEST_TOKEN, _longest_token)
    # the first ``limit`` tokens lie well inside this prefix (a schema's const or a grammar can
    # force hundreds of kB, tokenized and probed again at every step)
    text = _complete_utf8_prefix(forced[: (limit + FORCED_MARGIN) * longest])
    if not text:
        return []
    ids = tokenizer.backend_view(_FORCED_IDS, _forced_ids)(text)
    if ids is None:
        return []

    def chain(probe: MatcherBase, taken: int) -> list[int]:
        if taken < len(ids):  # a rejection: its last accepted token might merge with what follows
            return list(ids[: max(taken - 1, 0)][:limit])
        return list(ids[: taken if _only_stops_follow(probe) else taken - 1][:limit])

    return matcher.probe(ids, chain)


_FORCED_IDS = "espalier.constrained.backends.common.forced_ids"
_LONGEST_TOKEN = "espalier.constrained.backends.common.longest_token"
FORCED_MARGIN = 8
"""Tokens of forced text read past the ``limit`` asked for: a tokenization's last tokens may
change with the text after them, and only the first ``limit`` are used."""


def _longest_token(tokenizer: TokenizerInfo) -> int:
    return max(map(len, tokenizer.token_bytes), default=1)


FORCED_TEXTS = 4096
"""Forced texts whose canonical tokens are kept per tokenizer (a grammar forces the same key
and punctuation texts again and again; a tokenizer call costs tens of µs)."""


def _forced_ids(tokenizer: TokenizerInfo) -> Callable[[str], tuple[int, ...] | None]:
    """``text`` -> its canonical tokens, or None where they do not spell it byte for byte;
    kept for the last :data:`FORCED_TEXTS` texts (thread-safe)."""
    token_bytes = tokenizer.token_bytes

    @functools.lru_cache(maxsize=FORCED_TEXTS)
    def ids_of(text: str) -> tuple[int, ...] | None:
        ids = tuple(tokenizer.encode_text(text))
        if b"".join(token_bytes[t] for t in ids) != text.encode("utf-8"):
            return None
        return ids

    return ids_of


def _only_stops_follow(matcher: Any) -> bool:
    row = bm.allocate(1, matcher.vocab_size, fill=0)
    matcher.fill_bitmask(row, 0)
    stop_row: torch.Tensor = matcher._facts.stop_row
    return bool(torch.equal(row[0] & ~stop_row, torch.zeros_like(stop_row)))


def _complete_utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that is complete UTF-8, decoded."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def schema_refusal(backend: str, spec: GrammarSpec, detail: str) -> GrammarError:
    """A backend's failure to build a JSON schema as the error to raise: the schema's own
    error where it is invalid (``guard.check_schema``, with its pointer), else UNSUPPORTED: a
    valid schema a backend cannot build (outlines-core's ``^a$|^b$``, llguidance's recursive
    ``$ref`` beside siblings) says nothing against the schema."""
    from espalier.constrained.schema.guard import check_schema

    try:
        check_schema(spec.schema)
    except InvalidGrammarError as invalid:
        return invalid
    return UnsupportedGrammarError(backend, spec.kind.value, detail)
