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
guess. An anchor away from the ends (``^(/?(a|b)($|/))*$``) stays in the tree as an
:class:`Anchor` (a zero-width assertion the automaton checks). :func:`search_constraints` also
reads lookaheads where they say an intersection: ``^(?=X)`` / ``^(?!X)`` right after a leading
``^`` (the string does / does not start with a match of ``X``) and a trailing ``(?=X)`` (the
same strings as ``X`` concatenated, under search). What is not read here (other lookaround,
backreferences, ``\\b``, flags, possessive quantifiers, a repeated lone anchor) raises
:class:`Unsupported`: the caller then leaves the keyword alone, never approximates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import regex

MAX_PATTERN_CHARS = 2000
MAX_REPEAT = 1000  # a {m,n} bound past this is left alone (the automaton grows with it)
_SINGLE_ESCAPES = frozenset("dDwWsSpPxuUNntrfva0")
QUANTIFIER = regex.compile(r"\{(\d*)(?:(,)(\d*))?\}")
"""A counted repetition as the ``regex`` module reads one (``{m}``, ``{m,}``, ``{,n}``,
``{m,n}``; without digits it is literal text)."""


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
class Anchor:
    """Zero-width: ``^`` the start, ``$`` the end or before one final ``\\n``, ``$z`` the end."""

    kind: str


@dataclass(frozen=True)
class _Look:
    """A lookahead group as parsed (``negated``: ``(?!...)``); never in a returned tree."""

    group: Alt
    negated: bool


Node = Chars | Repeat | Alt | Anchor | _Look
ANY = Chars(((0, 0x10FFFF),))
NEWLINE = Chars(((10, 10),))


def search_language(pattern: str) -> Alt:
    """The strings ``regex.search(pattern, s)`` accepts, as a node tree (anchors left only
    where they are away from the ends). Lookaround raises :class:`Unsupported`."""
    constraints = search_constraints(pattern)
    if len(constraints) > 1:
        raise Unsupported("a lookahead (an intersection: see search_constraints)")
    return constraints[0][0]


def search_constraints(
    pattern: str,
    final_newline: bool = True,
    ascii_classes: bool = False,
    max_chars: int = MAX_PATTERN_CHARS,
) -> tuple[tuple[Alt, bool], ...]:
    """The strings ``regex.search(pattern, s)`` accepts, as the intersection of the languages
    of the trees (each complemented where its flag is set); the first is the pattern's body.
    ``ascii_classes``: ``\\d``, ``\\w``, ``\\s`` (and ``\\D``, ... in classes too) as
    ECMA-262 and ``regex``'s ASCII flag read them (``[0-9]``, ``[A-Za-z0-9_]``): JSON Schema's
    reading, where the post-validator's is Unicode. ``max_chars``: longer patterns are not read
    (a caller whose use of the trees stays linear in them may read longer ones)."""
    if len(pattern) > max_chars:
        raise Unsupported(f"pattern longer than {max_chars} characters")
    from espalier.constrained.regex_dialect import too_many_copies

    problem = too_many_copies(pattern)  # (admission refuses it first: schema/guard.py)
    if problem is not None:
        raise Unsupported(problem)
    try:
        regex.compile(pattern)
    except regex.error as exc:
        raise Unsupported(f"not a valid pattern: {exc}") from exc
    parser = _Parser(pattern, ascii_classes)
    group = parser.alternatives()
    if parser.at < len(pattern):
        raise Unsupported(f"unbalanced ')' at {parser.at}")
    looks: list[tuple[Alt, bool]] = []
    if len(group.options) == 1:
        items = list(group.options[0])
        while len(items) > 1 and items[0] == Anchor("^") and isinstance(items[1], _Look):
            look = items.pop(1)
            assert isinstance(look, _Look)
            looks.append((Alt(((Anchor("^"), look.group),)), look.negated))
        last = items[-1] if items else None
        if isinstance(last, _Look) and not last.negated:
            items[-1] = last.group  # R(?=X) finds a match exactly where RX does
        group = Alt((tuple(items),))
    trees = [(group, False), *looks]
    if any(_has(tree, _Look) for tree, _ in trees):
        raise Unsupported("lookaround other than a leading ^(?=...) / ^(?!...) or a final (?=...)")
    return tuple((_searched(tree, final_newline), negated) for tree, negated in trees)


def has_inner_anchor(pattern: str) -> bool:
    """Whether the pattern is read with an :class:`Anchor` left inside (False if not read)."""
    try:
        return _has(search_language(pattern), Anchor)
    except Unsupported:
        return False


def _searched(group: Alt, final_newline: bool) -> Alt:
    """``group`` under search semantics: anchors at the ends become open or closed ends, others
    stay as :class:`Anchor` assertions between two open ends."""
    try:
        return _anchored(group, False, False, final_newline)
    except _InnerAnchor:
        body = group if final_newline else _end_only(group)
        return Alt(((Repeat(ANY, 0, None), body, Repeat(ANY, 0, None)),))


def _end_only(node: Node) -> Node:
    """``node`` with each ``$`` read as the end only (the backends' reading)."""
    if node == Anchor("$"):
        return Anchor("$z")
    if isinstance(node, Repeat):
        return Repeat(_end_only(node.item), node.low, node.high)
    if isinstance(node, Alt):
        return Alt(tuple(tuple(_end_only(i) for i in option) for option in node.options))
    return node


class _InnerAnchor(Unsupported):
    """An anchor away from the ends: read as an assertion instead (:func:`_searched`)."""


def _anchored(group: Alt, start: bool, end: bool, final_newline: bool) -> Alt:
    """``group`` under search semantics; ``start`` / ``end``: already anchored there."""
    options: list[tuple[Node, ...]] = []
    for items in group.options:
        first = bool(items) and items[0] == Anchor("^")
        last = bool(items) and items[-1] == Anchor("$") and (len(items) > 1 or not first)
        body = items[first : len(items) - last]
        at_start, at_end = start or first, end or last
        if len(body) == 1 and isinstance(body[0], Alt) and _has(body[0], Anchor):
            options.extend(_anchored(body[0], at_start, at_end, final_newline).options)
            continue
        if any(_has(item, Anchor) for item in body):
            raise _InnerAnchor("an anchor inside the pattern")
        head: tuple[Node, ...] = () if at_start else (Repeat(ANY, 0, None),)
        tail = Repeat(NEWLINE, 0, int(final_newline)) if at_end else Repeat(ANY, 0, None)
        options.append((*head, *body, tail))
    return Alt(tuple(options))


def _has(item: Node, kind: type) -> bool:
    """Whether ``item`` holds a node of class ``kind`` (not looking inside lookaheads)."""
    if isinstance(item, kind):
        return True
    if isinstance(item, Repeat):
        return _has(item.item, kind)
    if isinstance(item, Alt):
        return any(_has(i, kind) for option in item.options for i in option)
    return False


class _Parser:
    """Recursive descent over the pattern text (depth bounded by the pattern's own nesting)."""

    def __init__(self, text: str, ascii_classes: bool) -> None:
        self.text = text
        self.at = 0
        self.depth = 0
        self.flags = "(?a)" if ascii_classes else ""

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
            return Anchor(char)
        if char == "(":
            return self.group()
        if char == "[":
            end = _class_end(text, at)
            self.at = end
            return oracle_class(self.flags + text[at:end])
        if char == "\\":
            end = _escape_end(text, at)
            self.at = end
            if end == at + 2 and not text[at + 1].isalnum():  # an escaped punctuation character
                return Chars(((ord(text[at + 1]), ord(text[at + 1])),))
            return oracle_class(self.flags + text[at:end])
        if char in "*+?":
            raise Unsupported(f"nothing to repeat at {at}")
        self.at += 1
        return oracle_class(char) if char == "." else Chars(((ord(char), ord(char)),))

    def group(self) -> Alt | _Look:
        text, at = self.text, self.at
        look = text[at + 2 : at + 3] if text.startswith("(?", at) else ""
        if look in ("=", "!") or text.startswith("(?:", at):
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
        return _Look(group, look == "!") if look in ("=", "!") else group

    def quantified(self, item: Node) -> Node:
        text = self.text
        while self.at < len(text):
            char = text[self.at]
            low: int
            high: int | None
            if char in "*+?":
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
                self.at += 1
            elif char == "{" and (match := QUANTIFIER.match(text, self.at)):
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
            if isinstance(item, (Anchor, _Look)):
                raise Unsupported("a repeated anchor or lookahead")
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
    """The code points ``atom`` (one single-character regex atom, after an optional ``(?a)``)
    matches under ``regex``."""
    flags = "(?a)" if atom.startswith("(?a)") else ""
    try:
        runs = regex.compile(f"{flags}(?:{atom[len(flags) :]})+")
    except regex.error as exc:
        raise Unsupported(f"{atom!r}: {exc}") from exc
    return Chars(tuple((m.start(), m.end() - 1) for m in runs.finditer(_all_code_points())))


@functools.cache
def _all_code_points() -> str:
    """Every code point in order (index = code point), surrogates included: 4.4 MB, built once."""
    return "".join(map(chr, range(0x110000)))
