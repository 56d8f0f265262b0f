"""GBNF (llama.cpp's grammar format) read into rules of characters, for the analyses backends
make of a grammar before they take it (``backends/llguidance/gbnf_lexing.py``).

The reading is llama.cpp's: a literal is a sequence of characters, a class a set of code
points (``\\xHH``, ``\\uHHHH``, ``\\UHHHHHHHH`` escapes of exactly that many hex digits), ``.``
any character, postfix ``*`` ``+`` ``?`` ``{m}`` ``{m,}`` ``{m,n}`` ``{,n}``, comments from
``#`` to the end of the line, a rule's body running until the next ``name ::=``, and a rule
defined twice holding its last definition (as ``gbnf_to_lark`` reads it). Only texts
a backend already accepted are read here, so :func:`parse` raises :class:`GbnfReadError` on
what it cannot read instead of explaining it; callers then make no claim about the grammar.

Character sets are sorted, disjoint, inclusive ``(low, high)`` code point intervals.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_CODE_POINT = 0x10FFFF
Chars = tuple[tuple[int, int], ...]
"""A set of code points: sorted, disjoint, non-adjacent inclusive intervals."""

ALL_CHARS: Chars = ((0, MAX_CODE_POINT),)

TOKEN = re.compile(
    r'(?P<lit>"(?:[^"\\]|\\.)*")'
    r"|(?P<cls>\[(?:[^\]\\]|\\.)*\])"
    r"|(?P<comment>#[^\n]*)"
    r"|(?P<define>::=)"
    r"|(?P<name>[A-Za-z0-9_-]+)"
    r"|(?P<open>\()"
    r"|(?P<close>\))"
    r"|(?P<bar>\|)"
    r"|(?P<space>\s+)"
    r"|(?P<dot>\.)"
    r"|(?P<count>\{\s*\d*\s*(?:,\s*\d*\s*)?\})"
    r"|(?P<other>.)",
    re.DOTALL,
)
"""GBNF's lexical pieces; ``lastgroup`` names each (``other``: a postfix operator or an error)."""


class GbnfReadError(ValueError):
    """A GBNF text :func:`parse` cannot read (no claim is made about it)."""


@dataclass(frozen=True)
class Text:
    """A literal: these characters in order (may be empty)."""

    chars: str


@dataclass(frozen=True)
class CharSet:
    """One character of ``chars`` (a class, or ``.``)."""

    chars: Chars


@dataclass(frozen=True)
class Ref:
    """The rule named ``name``."""

    name: str


@dataclass(frozen=True)
class Seq:
    """``items`` one after another (empty: the empty string)."""

    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    """One of ``options``."""

    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    """``node`` ``low`` to ``high`` times (``high`` None: unbounded)."""

    node: Node
    low: int
    high: int | None


Node = Text | CharSet | Ref | Seq | Alt | Repeat


def parse(source: str) -> dict[str, Node]:
    """The rules of ``source`` by name, in order of definition; raises GbnfReadError."""
    tokens = [
        (m.lastgroup or "other", m.group())
        for m in TOKEN.finditer(source)
        if m.lastgroup not in ("space", "comment")
    ]
    rules: dict[str, Node] = {}
    pos = 0
    while pos < len(tokens):
        if pos + 1 >= len(tokens) or tokens[pos][0] != "name" or tokens[pos + 1][0] != "define":
            raise GbnfReadError(f"expected a rule at token {pos}")
        name = tokens[pos][1]
        body, pos = _alternatives(tokens, pos + 2)
        rules.pop(name, None)  # a rule defined again: the last definition holds
        rules[name] = body
    if "root" not in rules:
        raise GbnfReadError("no root rule")
    for body in rules.values():
        for ref in refs(body):
            if ref not in rules:
                raise GbnfReadError(f"rule {ref} is not defined")
    return rules


def refs(node: Node) -> set[str]:
    """The rule names ``node`` refers to."""
    if isinstance(node, Ref):
        return {node.name}
    if isinstance(node, Seq):
        return set().union(*(refs(n) for n in node.items))
    if isinstance(node, Alt):
        return set().union(*(refs(n) for n in node.options))
    if isinstance(node, Repeat):
        return refs(node.node)
    return set()


def repeat_size(rules: dict[str, Node]) -> int:
    """The most copies of one literal or class the counted repeats (``{m}``, ``{m,n}``) of
    ``rules`` ask for: the product of the larger bounds of the counts around it, through nested
    groups and rule references (``x ::= "a"{100}``, ``root ::= x{1000}``: 100,000); a rule
    inside its own expansion counts once. Why: a backend writes such repeats out
    (``regex_dialect.MAX_REPEAT``)."""
    sizes: dict[str, int] = {}

    def size(node: Node, active: frozenset[str]) -> int:
        if isinstance(node, Ref):
            if node.name in active or node.name not in rules:
                return 1
            if node.name not in sizes:
                sizes[node.name] = size(rules[node.name], active | {node.name})
            return sizes[node.name]
        if isinstance(node, Seq):
            return max((size(n, active) for n in node.items), default=1)
        if isinstance(node, Alt):
            return max((size(n, active) for n in node.options), default=1)
        if isinstance(node, Repeat):
            return max(node.low, node.high or 0, 1) * size(node.node, active)
        return 1

    return max((size(Ref(name), frozenset()) for name in rules), default=1)


SHORTEST_CAP = 10**12
"""Shortest lengths are counted up to this (a grammar can double a rule into 2**60 characters)."""


def shortest_lengths(rules: dict[str, Node]) -> dict[str, int | None]:
    """Each rule's shortest text in characters (None: it derives no finite text; counts stop at
    :data:`SHORTEST_CAP`). A least fixpoint: a rule is looked at again only when one it refers
    to got shorter, so a long chain of rules costs its length, not its square (a shortest
    derivation nests no rule in itself: the rounds are at most the rules)."""
    users: dict[str, list[str]] = {}
    for name, body in rules.items():
        for ref in refs(body):
            users.setdefault(ref, []).append(name)
    best: dict[str, int] = {}

    def length(node: Node) -> int | None:
        if isinstance(node, Ref):
            return best.get(node.name)
        if isinstance(node, Text):
            return len(node.chars)
        if isinstance(node, CharSet):
            return 1 if node.chars else None
        if isinstance(node, Seq):
            total = 0
            for item in node.items:
                part = length(item)
                if part is None:
                    return None
                total += part
            return min(total, SHORTEST_CAP)
        if isinstance(node, Alt):
            options = [n for n in map(length, node.options) if n is not None]
            return min(options) if options else None
        if node.low == 0:  # Repeat
            return 0
        inner = length(node.node)
        return None if inner is None else min(node.low * inner, SHORTEST_CAP)

    pending = list(rules)
    while pending:
        shorter = []
        for name in dict.fromkeys(pending):
            value = length(rules[name])
            if value is not None and value < best.get(name, SHORTEST_CAP + 1):
                best[name] = value
                shorter.append(name)
        pending = [user for name in shorter for user in users.get(name, ())]
    return {name: best.get(name) for name in rules}


def _ends_sequence(tokens: list[tuple[str, str]], pos: int) -> bool:
    if pos >= len(tokens) or tokens[pos][0] in ("bar", "close"):
        return True
    return tokens[pos][0] == "name" and pos + 1 < len(tokens) and tokens[pos + 1][0] == "define"


def _alternatives(tokens: list[tuple[str, str]], pos: int) -> tuple[Node, int]:
    options = []
    while True:
        items: list[Node] = []
        while not _ends_sequence(tokens, pos):
            atom, pos = _atom(tokens, pos)
            atom, pos = _postfix(atom, tokens, pos)
            items.append(atom)
        options.append(items[0] if len(items) == 1 else Seq(tuple(items)))
        if pos < len(tokens) and tokens[pos][0] == "bar":
            pos += 1
            continue
        return (options[0] if len(options) == 1 else Alt(tuple(options))), pos


def _atom(tokens: list[tuple[str, str]], pos: int) -> tuple[Node, int]:
    kind, text = tokens[pos]
    if kind == "lit":
        return Text("".join(chr(c) for _, c in _units(text[1:-1]))), pos + 1
    if kind == "cls":
        return CharSet(_char_class(text[1:-1])), pos + 1
    if kind == "dot":
        return CharSet(ALL_CHARS), pos + 1
    if kind == "name":
        return Ref(text), pos + 1
    if kind == "open":
        inner, pos = _alternatives(tokens, pos + 1)
        if pos >= len(tokens) or tokens[pos][0] != "close":
            raise GbnfReadError("unclosed group")
        return inner, pos + 1
    raise GbnfReadError(f"unexpected {text!r}")


def _postfix(node: Node, tokens: list[tuple[str, str]], pos: int) -> tuple[Node, int]:
    while pos < len(tokens):
        kind, text = tokens[pos]
        high: int | None
        if kind == "other" and text in "*+?":
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[text]
        elif kind == "count":
            parts = [p.strip() for p in text[1:-1].split(",")]
            low = int(parts[0]) if parts[0] else 0
            high = low if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
            if high is not None and high < low:
                raise GbnfReadError("a count's maximum is below its minimum")
        else:
            return node, pos
        node, pos = Repeat(node, low, high), pos + 1
    return node, pos


_ESCAPES = {"t": 9, "r": 13, "n": 10}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


def _units(body: str) -> list[tuple[str, int]]:
    """A literal's or class's body as (unit as written, its code point) pairs, one per
    character or escape, escapes read as llama.cpp reads them."""
    out: list[tuple[str, int]] = []
    i = 0
    while i < len(body):
        if body[i] != "\\":
            out.append((body[i], ord(body[i])))
            i += 1
            continue
        if i + 1 >= len(body):
            raise GbnfReadError("a trailing backslash")
        code = body[i + 1]
        n = _HEX_DIGITS.get(code, 0)
        unit = body[i : i + 2 + n]
        if n:
            digits = unit[2:]
            if len(digits) != n or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise GbnfReadError(f"\\{code} needs {n} hex digits")
            out.append((unit, int(digits, 16)))
        else:
            out.append((unit, _ESCAPES.get(code, ord(code))))
        i += len(unit)
    return out


def _char_class(body: str) -> Chars:
    """The set a class's body (between the brackets) names: a ``-`` written bare between two
    units is a range."""
    negated = body.startswith("^")
    units = _units(body[1:] if negated else body)
    intervals: list[tuple[int, int]] = []
    i = 0
    while i < len(units):
        if i + 2 < len(units) and units[i + 1][0] == "-":
            intervals.append((units[i][1], units[i + 2][1]))
            i += 3
        else:
            intervals.append((units[i][1], units[i][1]))
            i += 1
    chars = normalize(intervals)
    return complement(chars) if negated else chars


def normalize(intervals: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> Chars:
    """``intervals`` as a :data:`Chars` (sorted, merged; empty intervals dropped)."""
    out: list[tuple[int, int]] = []
    for low, high in sorted(i for i in intervals if i[0] <= i[1]):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return tuple(out)


def union(*sets: Chars) -> Chars:
    """The code points in any of ``sets``."""
    return normalize([i for s in sets for i in s])


def complement(chars: Chars) -> Chars:
    """The code points not in ``chars``."""
    out: list[tuple[int, int]] = []
    start = 0
    for low, high in chars:
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return tuple(out)


def intersect(a: Chars, b: Chars) -> Chars:
    """The code points in both ``a`` and ``b``."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if low <= high:
            out.append((low, high))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)
