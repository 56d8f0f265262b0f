"""A JSON Schema ``pattern`` read as a regular language, with the post-validator's meaning.

:func:`search_language` gives the set of strings ``s`` for which ``regex.search(pattern, s)``
holds (the ``regex`` module is the post-validator's and the probe tests' oracle, see
:mod:`postvalidate`): an unanchored pattern matches anywhere, ``^`` only at the start, ``$`` at
the end or before one final ``\\n`` (no flags: ``.`` is any character but ``\\n``). The language
is a tree of :class:`Alt` / :class:`Repeat` / :class:`Chars` nodes over code points, without
anchors (``.*`` stands in for an open end).

Every single-character atom (a literal, an escape such as ``\\d`` / ``\\w`` / ``\\p{L}`` /
``\\u00e9``, a ``[...]`` class, ``.``) gets its character set from the oracle itself: the atom is
run over every code point once, so ``\\w`` is whatever ``regex`` calls a word character, not a
guess. What is not read here (lookaround, backreferences, ``\\b``, flags, possessive quantifiers,
anchors anywhere but at the ends of the pattern or of a top-level group's branches) raises
:class:`Unsupported`: the caller then leaves the keyword alone, never approximates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import regex

MAX_PATTERN_CHARS = 2000
MAX_REPEAT = 1000  # a {m,n} bound past this is left alone (the automaton grows with it)
_SINGLE_ESCAPES = frozenset("dDwWsSpPxuUNntrfva0")
_QUANTIFIER = regex.compile(r"\{(\d*)(?:(,)(\d*))?\}")


class Unsupported(Exception):
    """The pattern uses syntax read no further here; the message says which."""


@dataclass(frozen=True)
class Chars:
    """One character out of ``ranges``: sorted, disjoint, inclusive code point ranges."""

    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Repeat:
    item: Node
    low: int
    high: int | None  # None: unbounded


@dataclass(frozen=True)
class Alt:
    """One of ``options``, each a sequence of nodes (an empty one matches the empty string)."""

    options: tuple[tuple[Node, ...], ...]


@dataclass(frozen=True)
class _Anchor:
    kind: str  # "^" or "$"


Node = Chars | Repeat | Alt | _Anchor
ANY = Chars(((0, 0x10FFFF),))
NEWLINE = Chars(((10, 10),))


def search_language(pattern: str, final_newline: bool = True) -> Alt:
    """The strings ``regex.search(pattern, s)`` accepts, as a node tree without anchors.
    ``final_newline=False``: ``$`` is the end only, as the backends read it."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise Unsupported(f"pattern longer than {MAX_PATTERN_CHARS} characters")
    try:
        regex.compile(pattern)
    except regex.error as exc:
        raise Unsupported(f"not a valid pattern: {exc}") from exc
    parser = _Parser(pattern)
    group = parser.alternatives()
    if parser.at < len(pattern):
        raise Unsupported(f"unbalanced ')' at {parser.at}")
    return _anchored(group, False, False, final_newline)


def _anchored(group: Alt, start: bool, end: bool, final_newline: bool) -> Alt:
    """``group`` under search semantics; ``start`` / ``end``: already anchored there."""
    options: list[tuple[Node, ...]] = []
    for items in group.options:
        first = bool(items) and items[0] == _Anchor("^")
        last = bool(items) and items[-1] == _Anchor("$") and (len(items) > 1 or not first)
        body = items[first : len(items) - last]
        at_start, at_end = start or first, end or last
        if len(body) == 1 and isinstance(body[0], Alt) and _has_anchor(body[0]):
            options.extend(_anchored(body[0], at_start, at_end, final_newline).options)
            continue
        if any(_has_anchor(item) for item in body):
            raise Unsupported("an anchor inside the pattern (only at its ends is read)")
        head: tuple[Node, ...] = () if at_start else (Repeat(ANY, 0, None),)
        tail = Repeat(NEWLINE, 0, int(final_newline)) if at_end else Repeat(ANY, 0, None)
        options.append((*head, *body, tail))
    return Alt(tuple(options))


def _has_anchor(item: Node) -> bool:
    if isinstance(item, _Anchor):
        return True
    if isinstance(item, Repeat):
        return _has_anchor(item.item)
    if isinstance(item, Alt):
        return any(_has_anchor(i) for option in item.options for i in option)
    return False


class _Parser:
    """Recursive descent over the pattern text (depth bounded by the pattern's own nesting)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0
        self.depth = 0

    def alternatives(self) -> Alt:
        self.depth += 1
        if self.depth > 64:
            raise Unsupported("groups nested more than 64 deep")
        alts = [self.sequence()]
        while self.at < len(self.text) and self.text[self.at] == "|":
            self.at += 1
            alts.append(self.sequence())
        self.depth -= 1
        return Alt(tuple(alts))

    def sequence(self) -> tuple[Node, ...]:
        items: list[Node] = []
        while self.at < len(self.text) and self.text[self.at] not in "|)":
            items.append(self.quantified(self.atom()))
        return tuple(items)

    def atom(self) -> Node:
        text, at = self.text, self.at
        char = text[at]
        if char in "^$":
            self.at += 1
            return _Anchor(char)
        if char == "(":
            return self.group()
        if char == "[":
            end = _class_end(text, at)
            self.at = end
            return oracle_class(text[at:end])
        if char == "\\":
            end = _escape_end(text, at)
            self.at = end
            if end == at + 2 and not text[at + 1].isalnum():  # an escaped punctuation character
                return Chars(((ord(text[at + 1]), ord(text[at + 1])),))
            return oracle_class(text[at:end])
        if char in "*+?":
            raise Unsupported(f"nothing to repeat at {at}")
        self.at += 1
        return oracle_class(char) if char == "." else Chars(((ord(char), ord(char)),))

    def group(self) -> Alt:
        text, at = self.text, self.at
        if text.startswith("(?:", at):
            self.at = at + 3
        elif text.startswith("(?P<", at) or (
            text.startswith("(?<", at) and text[at + 3 : at + 4] not in ("=", "!")
        ):
            close = text.find(">", at)
            if close < 0:
                raise Unsupported("unterminated group name")
            self.at = close + 1
        elif text.startswith("(?", at):
            raise Unsupported(f"group syntax {text[at : at + 4]!r} (lookaround or flags)")
        else:
            self.at = at + 1
        group = self.alternatives()
        if self.at >= len(text) or text[self.at] != ")":
            raise Unsupported("unterminated group")
        self.at += 1
        return group

    def quantified(self, item: Node) -> Node:
        text = self.text
        while self.at < len(text):
            char = text[self.at]
            low: int
            high: int | None
            if char in "*+?":
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
                self.at += 1
            elif char == "{" and (match := _QUANTIFIER.match(text, self.at)):
                first, comma, second = match.groups()
                if not first and not comma:
                    return item  # "{}" is two literal characters: the next atom reads them
                low = int(first or 0)
                high = (int(second) if second else None) if comma else low
                if max(low, high or 0) > MAX_REPEAT:
                    raise Unsupported(f"a repetition bound over {MAX_REPEAT}")
                self.at = match.end()
            else:
                return item
            if isinstance(item, _Anchor):
                raise Unsupported("a repeated anchor")
            if text[self.at : self.at + 1] == "+":
                raise Unsupported("a possessive quantifier")
            if text[self.at : self.at + 1] == "?":
                self.at += 1  # lazy: the same set of strings matches
            item = Repeat(item, low, high)
        return item


def _escape_end(text: str, at: int) -> int:
    """Where the single-character escape starting at ``at`` ends."""
    letter = text[at + 1 : at + 2]
    if not letter:
        raise Unsupported("a trailing backslash")
    if letter.isalnum() and letter not in _SINGLE_ESCAPES:
        raise Unsupported(f"escape \\{letter} (a backreference, boundary or unknown escape)")
    if letter in "pPN" and text[at + 2 : at + 3] == "{":
        close = text.find("}", at)
        if close < 0:
            raise Unsupported("unterminated \\p{...}")
        return close + 1
    width = {"x": 2, "u": 4, "U": 8, "p": 1, "P": 1}.get(letter, 0)
    if letter == "0":
        digits = 0
        while digits < 2 and text[at + 2 + digits : at + 3 + digits] in tuple("01234567"):
            digits += 1
        width = digits
    return at + 2 + width


def _class_end(text: str, at: int) -> int:
    """Where the ``[...]`` starting at ``at`` ends (Python's rules: a first ``]`` is literal)."""
    i = at + 1
    if text[i : i + 1] == "^":
        i += 1
    if text[i : i + 1] == "]":
        i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == "[":
            raise Unsupported("'[' inside a character class (read differently by backends)")
        if text[i] == "]":
            return i + 1
        i += 1
    raise Unsupported("unterminated character class")


@functools.lru_cache(maxsize=4096)
def oracle_class(atom: str) -> Chars:
    """The code points ``atom`` (one single-character regex atom) matches under ``regex``."""
    try:
        runs = regex.compile(f"(?:{atom})+")
    except regex.error as exc:
        raise Unsupported(f"{atom!r}: {exc}") from exc
    return Chars(tuple((m.start(), m.end() - 1) for m in runs.finditer(_all_code_points())))


@functools.cache
def _all_code_points() -> str:
    """Every code point in order (index = code point), surrogates included: 4.4 MB, built once."""
    return "".join(map(chr, range(0x110000)))
