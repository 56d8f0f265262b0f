"""No JSON object repeats a key: a per-request key tracker over any backend's matcher.

The backends' JSON compilers emit each declared property at most once (declared properties come
in declared order; additional keys may not equal a declared name), but keys that come from
``additionalProperties``, ``patternProperties`` or an untyped object are free strings, and a
grammar cannot say "unlike every key before" (not context-free). So :class:`UniqueKeysMatcher`
wraps a request's matcher: a small JSON lexer follows the accepted bytes (the stack of open
containers, each object's keys so far), and a token that would *complete* a key already present
in its object (the closing quote of the key string, wherever in the token it falls) is removed
from the backend's row and rejected by ``accept``. Nothing else changes: the row is the backend's
row minus exactly those tokens.

Exactness: a key can still be extended or changed, so removing its duplicate completions leaves
a way on, unless the grammar's key language is finite and exhausted (``propertyNames: {"enum":
[...]}``, an anchored ``patternProperties`` with ``minProperties``). There every allowed token
would complete a duplicate; the tracker then removes nothing (a row is never emptied: the
request goes on and post-validation reports the duplicate) instead of leaving a dead end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from espalier.constrained import bitmask as bm
from espalier.constrained.spec import GrammarKind, GrammarSpec

if TYPE_CHECKING:
    from espalier.constrained.tokenizer import TokenizerInfo

QUOTE = 0x22
BACKSLASH = 0x5C

# A container on the lexer's stack: an object is (its keys so far, a key comes next), an array None
Frame = tuple[frozenset[bytes], bool] | None


@dataclass(frozen=True, slots=True)
class KeyState:
    """Where the lexer is (immutable: the rollback history keeps one per accepted token).

    stack: the open containers, innermost last. Keys are compared as unescaped UTF-8 bytes (as
    a JSON parser compares them: ``"a"`` and ``"\\u0061"`` are the same key)."""

    stack: tuple[Frame, ...] = ()
    key: bytes | None = None  # inside a key string: its unescaped bytes so far
    in_value: bool = False  # inside a value string
    escape: str = ""  # a pending escape ("\\", "\\u", "\\u12", ...) inside a string
    high: int = 0  # a \\u high surrogate waiting for its low half (inside a key)


START = KeyState()


def step(state: KeyState, data: bytes, *, strict: bool = True) -> KeyState | None:
    """The state after ``data``; None when ``data`` completes a key already in its object
    (``strict=False``: it goes on, the key counted once)."""
    stack, key, in_value, escape, high = (
        state.stack,
        state.key,
        state.in_value,
        state.escape,
        state.high,
    )
    for byte in data:
        if key is not None or in_value:
            if escape:
                escape, piece, high = _escape(escape + chr(byte), high)
                if key is not None and piece:
                    key += piece
            elif byte == BACKSLASH:
                escape = "\\"
            elif byte != QUOTE:
                if key is not None:
                    key += _utf8(high) + bytes((byte,))
                    high = 0
            elif in_value:
                in_value = False
            else:
                frame = stack[-1]
                assert frame is not None and key is not None
                key += _utf8(high)
                if strict and key in frame[0]:
                    return None
                stack = (*stack[:-1], (frame[0] | {key}, False))
                key, high = None, 0
        elif byte == QUOTE:
            top = stack[-1] if stack else None
            if top is not None and top[1]:
                key, high = b"", 0
            else:
                in_value = True
        elif byte == 0x7B:  # {
            stack = (*stack, (frozenset(), True))
        elif byte == 0x5B:  # [
            stack = (*stack, None)
        elif byte in (0x7D, 0x5D) and stack:  # } ]
            stack = stack[:-1]
        elif byte == 0x2C and stack and stack[-1] is not None:  # , in an object
            stack = (*stack[:-1], (stack[-1][0], True))
    return KeyState(stack, key, in_value, escape, high)


def _escape(text: str, high: int) -> tuple[str, bytes, int]:
    """A pending escape after one more character: (still pending, bytes it stands for, high
    surrogate kept). ``\\uD83D\\uDE00`` is one character, as JSON parsers read it."""
    if len(text) == 2 and text[1] != "u":
        simple = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}.get(text[1], text[1])
        return "", _utf8(high) + simple.encode(), 0
    if len(text) < 6:
        return text, b"", high
    point = int(text[2:], 16) if all(c in "0123456789abcdefABCDEF" for c in text[2:]) else 0xFFFD
    if 0xD800 <= point < 0xDC00:
        return "", _utf8(high), point
    if 0xDC00 <= point < 0xE000 and high:
        return "", chr(0x10000 + ((high - 0xD800) << 10) + (point - 0xDC00)).encode(), 0
    return "", _utf8(high) + _utf8(point), 0


def _utf8(point: int) -> bytes:
    return chr(point).encode("utf-8", "surrogatepass") if point else b""


@dataclass(frozen=True)
class KeyTables:
    """Per-tokenizer facts for the fast path (built once per tokenizer).

    by_prefix: for tokens holding a quote, the bytes before the first quote (no backslash among
        them) -> those token ids: inside a key with bytes ``P``, the ids that close it as key
        ``P + prefix``. simulate: ids whose first quote comes after a backslash, or that hold
        two quotes or more (they may close a key after opening it): run through :func:`step`
        when they may complete a duplicate: ``quoted[t]`` (the byte runs between two of their
        quotes) meets a key seen, or ``always`` (a backslash, or a run twice). by_run: each run
        of ``quoted`` -> the ids holding it, and always_ids: ``always`` as an array (outside a
        key string the candidates are these, found without a loop over ``simulate``).
    """

    token_bytes: list[bytes]
    by_prefix: dict[bytes, np.ndarray]
    simulate: np.ndarray  # int64 ids
    quoted: dict[int, frozenset[bytes]]
    always: frozenset[int]
    by_run: dict[bytes, np.ndarray]
    always_ids: np.ndarray  # int64 ids

    @classmethod
    def build(cls, tokenizer: TokenizerInfo) -> KeyTables:
        prefixes: dict[bytes, list[int]] = {}
        slow: list[int] = []
        quoted: dict[int, frozenset[bytes]] = {}
        always: set[int] = set()
        for token, data in enumerate(tokenizer.token_bytes):
            first = data.find(b'"')
            if first < 0:
                continue
            if b"\\" in data[:first] or data.count(b'"') > 1:
                slow.append(token)
                runs = data.split(b'"')[1:-1]
                quoted[token] = frozenset(runs) | {data[:first]}
                if b"\\" in data or len(set(runs)) < len(runs) or data[:first] in runs:
                    always.add(token)
            if b"\\" not in data[:first]:
                prefixes.setdefault(data[:first], []).append(token)
        by_prefix = {p: np.array(ids, dtype=np.int64) for p, ids in prefixes.items()}
        simulate = np.array(slow, dtype=np.int64)
        runs_to_ids: dict[bytes, list[int]] = {}
        for token, held in quoted.items():
            for run in held:
                runs_to_ids.setdefault(run, []).append(token)
        by_run = {run: np.array(ids, dtype=np.int64) for run, ids in runs_to_ids.items()}
        always_ids = np.array(sorted(always), dtype=np.int64)
        return cls(
            tokenizer.token_bytes,
            by_prefix,
            simulate,
            quoted,
            frozenset(always),
            by_run,
            always_ids,
        )

    def duplicates(self, state: KeyState, row: np.ndarray) -> list[int]:
        """The ids allowed by ``row`` (int32 ``[W]``) that complete a duplicate key from
        ``state``."""
        found: list[int] = []
        key, stack = state.key, state.stack
        if key is not None and (state.escape or state.high):  # rare: check every quote token
            candidates = _allowed(row, np.concatenate([*self.by_prefix.values(), self.simulate]))
            return sorted(t for t in set(candidates) if step(state, self.token_bytes[t]) is None)
        if key is not None:
            frame = stack[-1]
            assert frame is not None
            for seen in frame[0]:
                if seen.startswith(key):
                    ids = self.by_prefix.get(seen[len(key) :])
                    if ids is not None:
                        found.extend(_allowed(row, ids))
        seen_anywhere: set[bytes] = set()
        for frame in stack:
            if frame is not None:
                seen_anywhere |= frame[0]
        if key is None:  # the tokens whose runs meet a key seen, or that always need a look
            pool = [self.by_run[seen] for seen in seen_anywhere if seen in self.by_run]
            for token in set(_allowed(row, np.concatenate([self.always_ids, *pool]))):
                if step(state, self.token_bytes[token]) is None:
                    found.append(token)
            return sorted(set(found))
        for token in _allowed(row, self.simulate):
            data, runs = self.token_bytes[token], self.quoted[token]
            # the key this token closes first may come again later in it
            first = key + data[: data.find(b'"')] if key is not None else None
            maybe = token in self.always or first in runs or not seen_anywhere.isdisjoint(runs)
            if maybe and step(state, data) is None:
                found.append(token)
        return sorted(set(found))


def _allowed(row: np.ndarray, ids: np.ndarray) -> list[int]:
    if not len(ids):
        return []
    ids = ids[ids < row.shape[0] * bm.BITS_PER_WORD]
    bits = (row[ids >> 5].astype(np.int64) >> (ids & 31)) & 1
    out: list[int] = ids[bits.astype(bool)].tolist()
    return out


def _tables(tokenizer: TokenizerInfo) -> KeyTables:
    tables: KeyTables = tokenizer.backend_view("espalier.constrained.json_keys", KeyTables.build)
    return tables


def may_repeat_keys(spec: GrammarSpec) -> bool:
    """Whether ``spec``'s language holds an object whose keys are not all declared properties
    (so a backend could repeat one). Conservative: True when unsure."""
    if spec.kind is GrammarKind.ANY_JSON:
        return True
    if spec.kind is not GrammarKind.JSON_SCHEMA:
        return False
    return _free_keys(spec.schema)


def _free_keys(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return schema is True
    kind = schema.get("type")
    objects = kind is None or kind == "object" or (isinstance(kind, list) and "object" in kind)
    if "enum" in schema or "const" in schema:
        objects = False
    if objects and (
        schema.get("additionalProperties", True) is not False or "patternProperties" in schema
    ):
        return True
    return any(_free_keys(sub) for sub in _subschemas(schema))


def _subschemas(schema: dict[str, Any]) -> Iterable[Any]:
    for word in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        value = schema.get(word)
        if isinstance(value, dict):
            yield from value.values()
    for word in ("items", "prefixItems", "anyOf", "oneOf", "allOf"):
        value = schema.get(word)
        yield from value if isinstance(value, list) else [value] if value is not None else []
    for word in ("additionalProperties", "additionalItems", "contains", "then", "else"):
        if isinstance(schema.get(word), dict):
            yield schema[word]
