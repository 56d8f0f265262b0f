"""Lexer hazards of a grammar for llguidance, checked before it compiles: the longest literal its
lexer walks, and terminals that repeat one string without bound (:func:`hanging_terminal`).

llguidance's lexer works on derivatives of regular expressions: inside a literal of n bytes
(a ``const`` or ``enum`` string, a property name, a choice option, a Lark string, a regex
``a{30000}`` or ``(abc){1000}``) each token mask rebuilds the rest of it, so a mask costs O(n).
Gemma vocabulary, this project's 2-core CPU: 0.66 ms a mask at 3 KB, 11 ms at 30 KB, and past
about 10**6 bytes the second mask fails ("too many expressions constructed"); xgrammar masks the
same grammars in 2-3 µs. One request's slow masks hold every step of the batch it runs in, so
llguidance does not take a grammar with a literal over :data:`MAX_LITERAL_BYTES`; ``auto``
compiles it on the next backend that enforces it.

Lengths are UTF-8 bytes, an upper estimate where the text cannot be read exactly (a regex
Python's parser refuses, a Lark or GBNF grammar): enough to refuse the slow grammars, never a
grammar whose literals are all short.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from re import _constants, _parser  # type: ignore[attr-defined]
from typing import Any

from espalier.constrained.spec import GrammarKind, GrammarSpec

MAX_LITERAL_BYTES = 4096
"""About 1 ms a mask on the CPU above: at most that per request and step."""

_QUOTED = re.compile(r'"((?:[^"\\\n]|\\.)*)"|\'((?:[^\'\\\n]|\\.)*)\'')
_SLASHED = re.compile(r"/((?:[^/\\\n]|\\.)+)/")
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_PLAIN_RUN = re.compile(r"[^\\^$.|?*+()\[\]{}]+")


def longest_literal(spec: GrammarSpec) -> int:
    """The byte length of the longest literal in ``spec`` as llguidance would lex it."""
    kind = spec.kind
    if kind is GrammarKind.CHOICE:
        return max((_bytes(option) for option in spec.choices), default=0)
    if kind is GrammarKind.REGEX:
        return regex_literal(spec.source)
    if kind is GrammarKind.JSON_SCHEMA:
        return schema_literal(spec.schema)
    if kind in (GrammarKind.LARK, GrammarKind.EBNF):
        return grammar_literal(spec.source)
    if kind is GrammarKind.STRUCTURAL_TAG:
        return _tag_literal(json.loads(spec.source))
    return 0  # ANY_JSON: no literal past a keyword


def schema_literal(schema: Any) -> int:
    """The longest literal of a JSON schema: ``const`` and ``enum`` strings (inside objects and
    arrays too), property names, and the regexes of ``pattern`` and ``patternProperties``.
    Annotations (``description``, ``examples``, ...) are not compiled and do not count."""
    return max((n for n in _schema_literals(schema)), default=0)


def _schema_literals(node: Any) -> Iterator[int]:
    if isinstance(node, list):
        for item in node:
            yield from _schema_literals(item)
        return
    if not isinstance(node, dict):
        return
    for keyword, value in node.items():
        if keyword in ("const", "enum"):
            yield from _value_literals(value)
        elif keyword == "pattern" and isinstance(value, str):
            yield regex_literal(value)
        elif keyword in ("properties", "patternProperties", "$defs", "definitions"):
            if isinstance(value, dict):
                for name, child in value.items():
                    if keyword == "properties":
                        yield _bytes(name) + 2  # the quotes are part of the key's literal
                    elif keyword == "patternProperties":
                        yield regex_literal(name)
                    yield from _schema_literals(child)
        elif isinstance(value, (dict, list)) and keyword not in _NOT_COMPILED:
            yield from _schema_literals(value)


_NOT_COMPILED = frozenset({"examples", "default", "description", "title", "$comment"})


def _value_literals(value: Any) -> Iterator[int]:
    """The literals of a ``const`` / ``enum`` value: its strings (keys included), quoted."""
    if isinstance(value, str):
        yield len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
    elif isinstance(value, list):
        for item in value:
            yield from _value_literals(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield len(json.dumps(key, ensure_ascii=False).encode("utf-8"))
            yield from _value_literals(item)


def regex_literal(pattern: str) -> int:
    """The longest run of bytes ``pattern`` fixes in a row: literal characters, and groups and
    counted repetitions (``{n}``, ``{n,n}``) made only of them, concatenated."""
    parsed = _parse(pattern)
    if parsed is None:
        return _regex_text_estimate(pattern)
    try:
        return _longest(parsed)
    except RecursionError:
        return _regex_text_estimate(pattern)


def _regex_text_estimate(pattern: str) -> int:
    """For a regex Python does not read (ECMA ``\\p{L}``, counts past 2**32): its longest run
    of plain characters, or its largest count times 4 bytes, whichever is more."""
    runs = max((_bytes(run) for run in _PLAIN_RUN.findall(pattern)), default=0)
    counts = [
        int(match.group(1))
        for match in _COUNT.finditer(pattern)
        if (not match.group(2) or match.group(2) == match.group(1))
        and _repeats_literal(pattern, match.start())
    ]
    return max(runs, 4 * max(counts, default=0))


def _repeats_literal(pattern: str, at: int) -> bool:
    """Whether the count at ``at`` may repeat a literal: it follows a plain character (not an
    escape) or a group; not a class (``]``, ``\\d``, ``\\p{L}``), ``.`` or another count."""
    if at == 0:
        return False
    before = pattern[at - 1]
    if before == ")":
        return True
    escaped = at >= 2 and pattern[at - 2] == "\\"
    return not escaped and before not in "]}.*+?"


def _fixed(items: Any) -> int | None:
    """Bytes of the one string ``items`` (a parsed sequence) matches, None if not one string."""
    total = 0
    for op, av in items:
        if op is _constants.LITERAL:
            total += _bytes(chr(av))
        elif op is _constants.AT:
            continue  # an anchor: no bytes
        elif op is _constants.SUBPATTERN:
            inner = _fixed(av[3])
            if inner is None:
                return None
            total += inner
        elif op in _REPEATS and av[0] == av[1]:
            inner = _fixed(av[2])
            if inner is None:
                return None
            total += av[0] * inner
        else:
            return None
    return total


def _longest(items: Any) -> int:
    """The longest fixed run in a parsed sequence: consecutive fixed items add up; any other
    item ends the run and counts by the runs inside it."""
    best = run = 0
    for op, av in items:
        fixed = _fixed([(op, av)])
        if fixed is not None:
            run += fixed
            best = max(best, run)
            continue
        run = 0
        if op is _constants.BRANCH:
            inner = max((_longest(branch) for branch in av[1]), default=0)
        elif op is _constants.SUBPATTERN:
            inner = _longest(av[3])
        elif op in _REPEATS:
            body = _fixed(av[2])
            inner = max(_longest(av[2]), av[0] * body if body is not None else 0)
        elif op in (_constants.ASSERT, _constants.ASSERT_NOT):
            inner = _longest(av[1])
        elif op is _constants.ATOMIC_GROUP:
            inner = _longest(av)
        else:
            inner = 0
        best = max(best, inner)
    return best


_REPEATS = frozenset({_constants.MAX_REPEAT, _constants.MIN_REPEAT, _constants.POSSESSIVE_REPEAT})


def _parse(pattern: str) -> Any:
    """Python's parse of ``pattern`` (its ``re`` syntax tree), None where it cannot read it."""
    try:
        return _parser.parse(pattern)
    except (re.error, OverflowError, RecursionError, ValueError):
        return None


def grammar_literal(source: str) -> int:
    """The longest literal of a Lark or GBNF grammar: its quoted strings (a ``%json`` block's
    strings among them), its ``/regex/`` terminals, and a quoted string repeated ``{n}`` times."""
    best = 0
    for match in _QUOTED.finditer(source):
        text = match.group(1) if match.group(1) is not None else match.group(2)
        length = _bytes(text)
        count = _COUNT.match(source, match.end())
        if count is not None and (not count.group(2) or count.group(2) == count.group(1)):
            length *= int(count.group(1))
        best = max(best, length)
    for match in _SLASHED.finditer(source):
        best = max(best, regex_literal(match.group(1)))
    return best


def _tag_literal(node: Any) -> int:
    """The longest literal of a structural tag: ``const_string`` values, ``begin`` / ``end``
    strings, its JSON schemas, regexes and grammars."""
    if isinstance(node, list):
        return max((_tag_literal(item) for item in node), default=0)
    if not isinstance(node, dict):
        return 0
    best = 0
    for key, value in node.items():
        if key == "json_schema":
            best = max(best, schema_literal(value))
        elif key == "pattern" and isinstance(value, str):
            best = max(best, regex_literal(value))
        elif key == "grammar" and isinstance(value, str):
            best = max(best, grammar_literal(value))
        elif key in ("value", "begin", "end", "triggers"):
            strings = value if isinstance(value, list) else [value]
            best = max(best, *(_bytes(s) for s in strings if isinstance(s, str)), 0)
        elif isinstance(value, (dict, list)):
            best = max(best, _tag_literal(value))
    return best


def _bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def hanging_terminal(lark: str) -> str | None:
    """The first ``/regex/`` terminal of a Lark grammar that repeats one fixed string without
    bound (``/a+/``, ``/ +/``, ``/[a]+/``, ``/(ab)+/``, ``/a{2,}/``), or None.

    llguidance 1.9.1's mask never returns once such a terminal may be followed by a terminal
    that starts with that string (``/a+/ /a/``, ``/ +/ " "``, ``/ba+/ /a/``; not ``/a*/ /a/``,
    ``/[a-z]+/ /x/``, ``/[0-9]+/ "0"``), at any state, even after the start state passed: one
    request stalled every request of the engine. Its parser limits do not stop it. Every such
    terminal is refused, followed or not (``docs/decisions/regex-dialect.md``)."""
    for match in _SLASHED.finditer(lark):
        parsed = _parse(match.group(1))  # None: not a regex we read (a "/" in a string)
        if parsed is not None and _unbounded_fixed(parsed):
            return match.group()
    return None


def _unbounded_fixed(items: Any) -> bool:
    for op, av in items:
        if op in _REPEATS:
            body = av[2]
            fixed = _fixed(body) is not None or _single_member(body)
            if av[0] >= 1 and av[1] == _constants.MAXREPEAT and fixed:
                return True
            if _unbounded_fixed(body):
                return True
            continue
        inner = [av[3]] if op is _constants.SUBPATTERN else av[1] if op is _constants.BRANCH else []
        if any(_unbounded_fixed(part) for part in inner):
            return True
    return False


def _single_member(items: Any) -> bool:
    """Whether ``items`` is one class holding one character (``[a]``)."""
    if len(items) != 1 or items[0][0] is not _constants.IN:
        return False
    members = items[0][1]
    return len(members) == 1 and members[0][0] is _constants.LITERAL
