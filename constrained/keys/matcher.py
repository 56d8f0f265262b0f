"""A :class:`GrammarMatcher` whose JSON objects never repeat a key, and whose unique arrays never
repeat an item: a backend's matcher plus the native tracker (package docstring).

:func:`with_unique_keys` wraps a request's matcher when its grammar can hold objects with free
keys (:func:`may_repeat_keys`) or arrays that must hold unique items (the schema's
:func:`~espalier.constrained.schema.unique_places.unique_places`, marked at compile time); other
matchers are returned as they are. Rows are the backend's rows minus the tokens that would
complete a key already in its object or an item already in its unique array; ``accept`` rejects
exactly those tokens. A batch's rows are the inner matchers' batch fill, then one native call
filtering them all (:attr:`UniqueKeysMatcher.row_filter`); a draft tree's rows are the backend's
walk, then one native call filtering them node by node (:meth:`UniqueKeysMatcher.fill_tree`), or,
in a step's tree batch, the same filter applied inside the batch's native call
(:attr:`UniqueKeysMatcher.native_tree_filter`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.keys.frames import MAX_FRAME_BYTES, scan_automaton
from espalier.constrained.keys.native import (
    FrameTable,
    KeyTables,
    KeyTracker,
    PlaceTable,
    filter_rows,
    filter_tree_address,
)
from espalier.constrained.spec import GrammarKind, GrammarSpec

if TYPE_CHECKING:
    from espalier.constrained.base import (
        BatchStep,
        GrammarMatcher,
        NativeClosing,
        RowFilter,
        TreeBatch,
    )
    from espalier.constrained.structural_tag import Framing
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.constrained.tree import DraftTree
    from espalier.constrained.tree.masks import TreeMasks


def with_unique_keys(
    spec: GrammarSpec, matcher: GrammarMatcher, tokenizer: TokenizerInfo
) -> GrammarMatcher:
    """``matcher`` itself, or wrapped so that no object of its output repeats a key and no
    array the schema wants unique repeats an item."""
    if spec.kind is GrammarKind.STRUCTURAL_TAG:
        frames = _framed_free_keys(spec.source)
        if frames is None:
            return matcher
        return UniqueKeysMatcher(matcher, KeyTracker(_tables(tokenizer), None, frames[0]))
    places = _place_table(spec.source) if spec.kind is GrammarKind.JSON_SCHEMA else None
    if places is None and not may_repeat_keys(spec):
        return matcher
    return UniqueKeysMatcher(matcher, KeyTracker(_tables(tokenizer), places))


@functools.lru_cache(maxsize=256)
def _untracked(kind: GrammarKind, source: str) -> tuple[tuple[str, str], ...]:
    return tuple(untracked_free_keys(GrammarSpec(kind, source)))


def repeats_unchecked(spec: GrammarSpec) -> bool:
    """Whether some JSON value of ``spec``'s output may repeat a key that no tracker follows
    (:func:`untracked_free_keys`, per grammar text): a replay cannot certify such an output."""
    return bool(_untracked(spec.kind, spec.source))


def untracked_free_keys(spec: GrammarSpec) -> list[tuple[str, str]]:
    """``(where, keyword)`` of the first free-key place (:func:`free_keys_at`) of each JSON
    value in ``spec`` that :func:`with_unique_keys` does not follow: a Lark grammar's ``%json``
    blocks (``where``: ``%json N`` and the pointer in its schema, N counted from 1) and a
    structural tag's JSON schemas outside :func:`tracks_framed_value`'s shapes (``where``: the
    pointer in the tag). The tracker reads values from places a scan finds; a value inside a
    grammar starts where the grammar chooses."""
    if spec.kind is GrammarKind.LARK:
        return _lark_free_keys(spec.source)
    if spec.kind is not GrammarKind.STRUCTURAL_TAG or tracks_framed_value(spec):
        return []
    from espalier.constrained.structural_tag import map_json_schemas, root_format

    found: list[tuple[str, str]] = []

    def note(node: dict[str, Any], pointer: str) -> dict[str, Any]:
        free = free_keys_at(node.get("json_schema"))
        if free is not None:
            found.append((f"{pointer}/json_schema{free[0]}", free[1]))
        return node

    map_json_schemas(root_format(spec), note)
    return found


def _lark_free_keys(source: str) -> list[tuple[str, str]]:
    decoder = json.JSONDecoder()
    out = []
    for n, block in enumerate(re.finditer(r"%json\b", source), 1):
        text = source[block.end() :]
        try:
            schema, _ = decoder.raw_decode(text, len(text) - len(text.lstrip()))
        except ValueError:
            continue  # not a schema here (a comment, a string): the backend reads the grammar
        found = free_keys_at(schema)
        if found is not None:
            out.append((f"%json {n} {found[0] or '/'}", found[1]))
    return out


def tracks_framed_value(spec: GrammarSpec) -> bool:
    """Whether :func:`with_unique_keys` follows every JSON value of a structural tag ``spec``:
    its values start where a scan finds them (``structural_tag.json_framing``), within
    :data:`~espalier.constrained.keys.frames.MAX_FRAME_BYTES`. Else its values are not
    followed: their objects may repeat keys."""
    return _framing_of(spec) is not None


def _framing_of(spec: GrammarSpec) -> Framing | None:
    from espalier.constrained.structural_tag import json_framing

    framing = json_framing(spec)
    if framing is None:
        return None
    size = len(framing.gate.encode()) + sum(len(b.encode()) for b in framing.begins)
    return framing if size <= MAX_FRAME_BYTES else None


@functools.lru_cache(maxsize=256)
def _framed_free_keys(source: str) -> tuple[FrameTable | None] | None:
    """The frames of a structural tag whose JSON values' objects may repeat keys (inside: None
    when the whole output is the value); None: no such value, or none followed. Per tag
    text, as :func:`_schema_has_free_keys`."""
    framing = _framing_of(GrammarSpec(GrammarKind.STRUCTURAL_TAG, source))
    if framing is None or not any(_free_keys(schema) for schema in framing.schemas):
        return None
    if not framing.gate and not framing.begins:
        return (None,)
    begins = tuple(b.encode() for b in framing.begins)
    return (FrameTable(scan_automaton(framing.gate.encode(), begins, framing.rearm)),)


@functools.lru_cache(maxsize=256)
def _place_table(source: str) -> PlaceTable | None:
    """The native places of a JSON schema's marked unique arrays (None: none), per schema."""
    from espalier.constrained.schema.unique_places import MARK, unique_places

    if MARK not in source:
        return None
    places = unique_places(GrammarSpec(GrammarKind.JSON_SCHEMA, source).schema)
    return PlaceTable(places) if places is not None else None


def _tables(tokenizer: TokenizerInfo) -> KeyTables:
    def build(tok: TokenizerInfo) -> KeyTables:
        return KeyTables(tok.token_bytes)

    tables: KeyTables = tokenizer.backend_view("espalier.constrained.keys", build)
    return tables


class UniqueKeysMatcher:
    """``inner`` (any matcher) with duplicate-key completions removed (package docstring).

    ``keys``: the native tracker, advanced and rolled back with ``inner`` (as many tokens)."""

    def __init__(self, inner: GrammarMatcher, keys: KeyTracker) -> None:
        self.inner = inner
        self.keys = keys
        self._row: torch.Tensor | None = None  # scratch row of the dead-end check, made on use
        self._dead_end: str | None = None  # why the last refused token was all the row allowed

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def exact_rollback(self) -> bool:
        return self.inner.exact_rollback

    @property
    def batch_kind(self) -> Callable[[int], BatchStep] | None:
        """None: batches fill ``inner`` (:attr:`row_filter`), never this wrapper."""
        return None

    @property
    def tree_batch_kind(self) -> Callable[[int], TreeBatch] | None:
        """None: a step's tree batch walks ``inner`` (:attr:`row_filter`) and applies
        :attr:`native_tree_filter` in the same native call."""
        return None

    @property
    def native_tree_filter(self) -> tuple[int, int]:
        """``keys.c``'s tree filter and this request's tracker (``RowFilter``)."""
        return filter_tree_address(), self.keys.handle

    @property
    def row_filter(self) -> RowFilter:
        """Rows are ``inner``'s minus the duplicate completions (``constrained/batch.py``)."""
        return self

    @property
    def source(self) -> GrammarMatcher:
        return self.inner

    @property
    def filter_kind(self) -> Callable[[Sequence[Any], torch.Tensor, Sequence[int], int], None]:
        return filter_batch

    def accept(self, token: int) -> bool:
        if not self._accept_keys(token):
            return False
        try:
            if self.inner.accept(token):
                return True
        except BaseException:
            self.keys.rollback(1)  # the two stay in step when the grammar fails
            raise
        self.keys.rollback(1)
        return False

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        if not tokens:
            return 0
        return self.settle(tokens, *self._round(tokens))

    def _round(self, tokens: Sequence[int]) -> tuple[int, int]:
        """The tracker advanced up to the first duplicate completion, and ``inner`` by as many
        of ``tokens`` as it takes of those: ``(clean, taken)`` (the tracker rolled back when
        ``inner`` raises)."""
        clean = self.take_clean(tokens)
        try:
            taken = self.inner.accept_tokens(tokens[:clean]) if clean else 0
        except BaseException:
            self.keys.rollback(clean)
            raise
        return clean, taken

    def take_clean(self, tokens: Sequence[int]) -> int:
        """The tracker advanced up to the first duplicate completion (``RowFilter``)."""
        return self.keys.accept_tokens(tokens)

    def settle(self, tokens: Sequence[int], clean: int, taken: int) -> int:
        """``RowFilter.settle``: the tracker back to ``inner``'s ``taken``; past a duplicate
        completion the dead-end rule decides (:meth:`accept`), and the rest goes on the same
        way, round by round."""
        self.keys.rollback(clean - taken)
        done = taken
        # stop where the grammar rejected, at the end, or at a duplicate the rule refuses
        while taken == clean and done < len(tokens) and self.accept(tokens[done]):
            done += 1
            clean, taken = self._round(tokens[done:])
            self.keys.rollback(clean - taken)
            done += taken
        return done

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        self.inner.rollback(n)
        self.keys.rollback(n)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        self.inner.fill_bitmask(bitmask, index)
        self.keys.filter_row(bitmask[index].numpy())

    def prepare(self, scratch: torch.Tensor) -> None:
        self.inner.prepare(scratch)  # the tracker keeps nothing a step would make

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def can_terminate(self) -> bool:
        return self.inner.can_terminate()

    def completes(self, tokens: Sequence[int]) -> bool:
        if not self.inner.completes(tokens):  # the tracker only refuses more (most tries end here)
            return False
        clean = self.keys.clean_prefix(tokens)
        if clean < len(tokens):  # a duplicate completion: the dead-end rule decides
            probe = self.fork()
            return probe.accept_tokens(tokens) == len(tokens) and probe.can_terminate()
        return True  # the tracker takes them all: the grammar's answer

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        # the grammar first (most probes end there), then the tracker on what it takes
        taken = self.inner.accepted_prefix(tokens)
        clean = self.keys.clean_prefix(tokens[:taken])
        if clean < taken:  # a duplicate completion: the dead-end rule decides, on a fork
            return self.fork().accept_tokens(tokens)
        return taken

    def forced_tokens(self, limit: int) -> list[int]:
        forced = self.inner.forced_tokens(limit)
        return forced[: self.keys.clean_prefix(forced)]

    def native_closing(self, token: int | None, limit: int, keys: int = 0) -> NativeClosing | None:
        """``inner``'s native search under this tracker's rules (``keys`` is this one's)."""
        return self.inner.native_closing(token, limit, self.keys.handle)

    def fork(self) -> UniqueKeysMatcher:
        return UniqueKeysMatcher(self.inner.fork(), self.keys.fork())

    def reset(self) -> None:
        self.inner.reset()
        self.keys.reset()

    def fill_tree(
        self,
        tree: DraftTree,
        out: torch.Tensor | np.ndarray,
        *,
        budget: float | None,
        root_row: torch.Tensor | np.ndarray | None = None,
        threads: int = 1,
    ) -> TreeMasks:
        """The backend matcher's own walk (``inner.fill_tree``), then one native call filtering
        the rows node by node (``keys.c``: a node whose token the filtered parent row forbids,
        or that completes a duplicate, is invalid with its subtree; a filled row loses its
        duplicate completions, never all of its tokens)."""
        masks = self.inner.fill_tree(tree, out, budget=budget, root_row=root_row, threads=threads)
        rows = out.numpy() if isinstance(out, torch.Tensor) else out
        flags = (masks.valid, masks.filled, masks.terminated)
        self.keys.filter_tree(tree.tokens, tree.first_child, tree.next_sibling, rows, flags)
        return masks

    def _accept_keys(self, token: int) -> bool:
        """Advance the tracker by ``token``; False when it completes a duplicate key or item
        (the dead-end rule: a row is never emptied, so where every allowed token completes a
        duplicate the row keeps them, and the one sampled is refused here: no invalid instance
        is accepted, and the request ends saying why, :meth:`refusal`)."""
        self._dead_end = None
        if self.keys.accept(token):
            return True
        row = self._row
        if row is None:
            row = self._row = bm.allocate(1, self.inner.vocab_size, fill=0)
        self.inner.fill_bitmask(row, 0)
        if self.keys.filter_row(row[0].numpy()):
            return False
        if self.keys.accept(token, strict=False):
            return True  # a needless escape the grammar forces (none of the backends does)
        self._dead_end = KEY_DEAD_END if self.keys.refused_key else ITEM_DEAD_END
        return False

    def refusal(self) -> str | None:
        """``RowFilter.refusal``: the dead end of a repeated key or unique item (package
        docstring), else None."""
        return self._dead_end


ITEM_DEAD_END = (
    "uniqueItems: every token the grammar allows here completes an item that its array already "
    "holds (the item so far can only end as that item, e.g. at its maxLength or at the end of "
    "its pattern); the tracker refuses duplicates one token at a time and cannot steer away "
    "earlier. Another seed, or a wider item schema, avoids it"
)
KEY_DEAD_END = (
    "duplicate key: every token the grammar allows here completes a key that its object already "
    "holds (the key so far can only end as that key, e.g. at the end of its pattern or "
    "propertyNames' maxLength, or the object needs more keys than its key schema can name); the "
    "tracker refuses duplicates one token at a time and cannot steer away earlier. Another seed, "
    "or a wider key schema, avoids it"
)


def filter_batch(
    filters: Sequence[UniqueKeysMatcher], bitmask: torch.Tensor, rows: Sequence[int], threads: int
) -> None:
    """``RowFilter.filter_kind`` of :class:`UniqueKeysMatcher`: ``bitmask[rows[j]]`` (filled
    from ``filters[j].inner``) filtered for all of them in one native call."""
    results = filter_rows([f.keys for f in filters], bitmask.numpy(), rows, threads)
    if (results < 0).any():
        raise MemoryError("key filter")


def may_repeat_keys(spec: GrammarSpec) -> bool:
    """Whether ``spec``'s language holds an object whose keys are not all declared properties
    (so a backend could repeat one). Conservative: True when unsure."""
    if spec.kind is GrammarKind.ANY_JSON:
        return True
    if spec.kind is not GrammarKind.JSON_SCHEMA:
        return False
    return _schema_has_free_keys(spec.source)


@functools.lru_cache(maxsize=256)
def _schema_has_free_keys(source: str) -> bool:
    """:func:`_free_keys` of a JSON schema's text, per schema: every request's matcher asks,
    and parsing and walking a large schema again costs up to half a millisecond, all of it
    holding the GIL on the grammar service's matcher threads."""
    return _free_keys(GrammarSpec(GrammarKind.JSON_SCHEMA, source).schema)


def _free_keys(schema: Any) -> bool:
    return free_keys_at(schema) is not None


def free_keys_at(schema: Any, pointer: str = "") -> tuple[str, str] | None:
    """``(pointer, keyword)`` of the first place in ``schema`` where an object's keys are not
    all declared properties (``keyword``: ``additionalProperties``, ``patternProperties``, or
    ``true`` for a schema that takes any value); None: no object of it may repeat a key."""
    if not isinstance(schema, dict):
        return (pointer, "true") if schema is True else None
    kind = schema.get("type")
    objects = kind is None or kind == "object" or (isinstance(kind, list) and "object" in kind)
    if "enum" in schema or "const" in schema:
        objects = False
    if objects and "patternProperties" in schema:
        return pointer, "patternProperties"
    if objects and schema.get("additionalProperties", True) is not False:
        return pointer, "additionalProperties"
    for at, sub in _subschemas(schema, pointer):
        found = free_keys_at(sub, at)
        if found is not None:
            return found
    return None


def _subschemas(schema: dict[str, Any], pointer: str) -> Iterable[tuple[str, Any]]:
    from espalier.constrained.schema.walk import escape_pointer_token

    for word in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        value = schema.get(word)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield f"{pointer}/{word}/{escape_pointer_token(name)}", sub
    for word in ("items", "prefixItems", "anyOf", "oneOf", "allOf"):
        value = schema.get(word)
        if isinstance(value, list):
            yield from ((f"{pointer}/{word}/{i}", sub) for i, sub in enumerate(value))
        elif value is not None:
            yield f"{pointer}/{word}", value
    for word in ("additionalProperties", "additionalItems", "contains", "then", "else"):
        if isinstance(schema.get(word), dict):
            yield f"{pointer}/{word}", schema[word]
