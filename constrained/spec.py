"""What the caller asked the output to match: a frozen, hashable grammar specification."""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from espalier.constrained import json_text
from espalier.constrained.errors import EmptyLanguageError, InvalidGrammarError

DEFAULT_MAX_GRAMMAR_BYTES = 1 << 20


class BackendName(str, enum.Enum):
    """The closed set of grammar backends (``constrained/backends/<value>/``). A ``str`` too,
    equal to its value, so it is the name that requests, reports and metrics carry."""

    XGRAMMAR = "xgrammar"
    LLGUIDANCE = "llguidance"
    OUTLINES_CORE = "outlines_core"

    def __str__(self) -> str:
        return self.value


class GrammarKind(enum.Enum):
    """The closed set of constraint kinds a request may carry."""

    JSON_SCHEMA = "json_schema"
    ANY_JSON = "any_json"
    REGEX = "regex"
    EBNF = "ebnf"  # GBNF dialect (llama.cpp)
    LARK = "lark"
    CHOICE = "choice"
    STRUCTURAL_TAG = "structural_tag"  # xgrammar's format (constrained/structural_tag.py)


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint. ``source`` is canonical text for its kind.

    - JSON_SCHEMA: the schema serialised without whitespace, keys in the caller's order (the
      backends generate properties in declared order, so the order is part of the meaning).
    - ANY_JSON: empty.
    - REGEX / EBNF / LARK: the text as given.
    - CHOICE: a JSON array of the literal strings, in the caller's order.
    - STRUCTURAL_TAG: ``{"type": "structural_tag", "format": ...}`` without whitespace, as
      ``constrained/structural_tag.py`` validates and rewrites it (legacy form included); built
      by ``structural_tag.structural_tag_spec``.
    """

    kind: GrammarKind
    source: str

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | bool | str, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    ) -> GrammarSpec:
        """Build from a schema object or its JSON text; raises InvalidGrammarError on bad JSON."""
        if isinstance(schema, str):
            check_size(GrammarKind.JSON_SCHEMA, schema, max_bytes)
            try:
                schema = json_text.loads(schema)
            except json_text.JSONTextError as exc:
                raise InvalidGrammarError(
                    GrammarKind.JSON_SCHEMA.value,
                    f"schema is not valid JSON: {exc.msg}",
                    line=exc.line,
                    column=exc.column,
                ) from exc
        if not isinstance(schema, (dict, bool)):
            raise InvalidGrammarError(
                GrammarKind.JSON_SCHEMA.value,
                f"a JSON schema must be an object or a boolean, got {type(schema).__name__}",
                pointer="",
            )
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        check_size(GrammarKind.JSON_SCHEMA, text, max_bytes)
        return cls(GrammarKind.JSON_SCHEMA, text)

    @classmethod
    def any_json(cls) -> GrammarSpec:
        return cls(GrammarKind.ANY_JSON, "")

    @classmethod
    def regex(cls, pattern: str, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> GrammarSpec:
        check_size(GrammarKind.REGEX, pattern, max_bytes)
        _python_regex(pattern)
        from espalier.constrained.regex_dialect import backend_spelling

        return cls(GrammarKind.REGEX, backend_spelling(pattern))

    @classmethod
    def ebnf(cls, grammar: str, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> GrammarSpec:
        check_size(GrammarKind.EBNF, grammar, max_bytes)
        if not grammar.strip():
            raise InvalidGrammarError(GrammarKind.EBNF.value, "grammar is empty")
        _check_grammar_text(GrammarKind.EBNF, grammar)
        return cls(GrammarKind.EBNF, grammar)

    @classmethod
    def lark(cls, grammar: str, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> GrammarSpec:
        check_size(GrammarKind.LARK, grammar, max_bytes)
        if not grammar.strip():
            raise InvalidGrammarError(GrammarKind.LARK.value, "grammar is empty")
        _check_grammar_text(GrammarKind.LARK, grammar)
        return cls(GrammarKind.LARK, grammar)

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> GrammarSpec:
        if not options:
            raise InvalidGrammarError(GrammarKind.CHOICE.value, "choice needs at least one option")
        for i, option in enumerate(options):
            if not isinstance(option, str) or not option:
                raise InvalidGrammarError(
                    GrammarKind.CHOICE.value, f"option {i} must be a non-empty string"
                )
        text = json.dumps(list(options), ensure_ascii=False)
        check_size(GrammarKind.CHOICE, text, DEFAULT_MAX_GRAMMAR_BYTES)
        return cls(GrammarKind.CHOICE, text)

    @property
    def schema(self) -> dict[str, Any] | bool:
        """The parsed schema of a JSON_SCHEMA spec."""
        assert self.kind is GrammarKind.JSON_SCHEMA
        value: dict[str, Any] | bool = json.loads(self.source)
        return value

    @property
    def choices(self) -> list[str]:
        """The options of a CHOICE spec."""
        assert self.kind is GrammarKind.CHOICE
        value: list[str] = json.loads(self.source)
        return value

    @property
    def cache_key(self) -> tuple[str, str]:
        """Canonical, compact key: (kind, sha256 of the canonical source)."""
        digest = hashlib.sha256(self.source.encode("utf-8")).hexdigest()
        return (self.kind.value, digest)

    def __repr__(self) -> str:
        preview = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"GrammarSpec({self.kind.value}, {preview!r})"


MAX_SHORTEST_TEXT = 250_000
"""The most characters the shortest text of a GBNF or Lark grammar may have: no output of a
served context reaches it, and a grammar doubling a rule per rule (22 deep: 4 million
characters) held the engine for 18 s and 2.3 GB, 26 deep until it was killed for memory."""


def check_size(kind: GrammarKind, text: str, max_bytes: int) -> None:
    """Raise InvalidGrammarError when ``text`` is over ``max_bytes`` UTF-8 bytes."""
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise InvalidGrammarError(
            kind.value, f"grammar is {size} bytes, over the limit of {max_bytes} bytes"
        )


def _check_grammar_text(kind: GrammarKind, grammar: str) -> None:
    """Refuse a GBNF or Lark grammar whose counted repeats ask for more than
    ``regex_dialect.MAX_REPEAT`` copies of one item (``"a"{1000000}``: the backends write it out,
    and one request held every request's steps for a minute), or that nests too deeply to read;
    a grammar whose root (GBNF's ``root``, Lark's ``start``) derives no finite text, or only
    texts over :data:`MAX_SHORTEST_TEXT` characters (``gbnf.shortest_lengths``: ``r0 ::= r1 r1``,
    ``r1 ::= r2 r2``, ... doubles per rule, and a backend wrote the one text out until the
    engine was killed for memory). A GBNF text the reader cannot read is left to the
    backends."""
    from espalier.constrained import gbnf
    from espalier.constrained.regex_dialect import MAX_REPEAT, lark_repeat_size, lark_rules

    root = "start" if kind is GrammarKind.LARK else "root"
    try:
        if kind is GrammarKind.LARK:
            rules, copies = lark_rules(grammar), lark_repeat_size(grammar)
        else:
            rules = gbnf.parse(grammar)
            copies = gbnf.repeat_size(rules)
        lengths = gbnf.shortest_lengths(rules)
    except gbnf.GbnfReadError:
        return
    except RecursionError:
        raise InvalidGrammarError(kind.value, "the grammar is nested too deeply") from None
    shortest = lengths.get(root, 0)  # a root that is not a rule: no claim
    if shortest is None:
        empty = [name for name, value in lengths.items() if value is None]
        raise EmptyLanguageError(
            kind.value,
            f"the grammar matches no finite text: rule {root!r} never ends (no alternative of "
            f"{', '.join(repr(n) for n in empty[:8])} avoids needing one of them again)",
        )
    if copies > MAX_REPEAT:
        raise InvalidGrammarError(
            kind.value,
            f"its counted repeats ask for {copies} copies of one item (nested counts and "
            f"rule references multiply), over the limit of {MAX_REPEAT}",
        )
    if shortest > MAX_SHORTEST_TEXT:
        raise InvalidGrammarError(
            kind.value,
            f"the shortest text rule {root!r} matches is over {MAX_SHORTEST_TEXT} characters "
            f"({shortest if shortest < gbnf.SHORTEST_CAP else 'astronomically many'}: rules "
            "referenced one after another add up)",
        )


def _python_regex(pattern: str) -> None:
    """Refuse a pattern Python's ``regex`` module does not compile: a regex constraint means
    what that module reads (``constrained/regex_dialect.py``), and the backends took some such
    patterns in a reading of their own (``a{1,3}{2}`` wrote ``aaaaaa``; ``\\x{1F600}``). A
    pattern whose counts ask for more than ``regex_dialect.MAX_REPEAT`` copies is refused first,
    uncompiled: compiling it would take the server's memory and GIL."""
    import regex

    from espalier.constrained.regex_dialect import too_many_copies

    problem = too_many_copies(pattern)
    if problem is not None:
        raise InvalidGrammarError(GrammarKind.REGEX.value, problem)
    try:
        regex.compile(pattern)
    except regex.error as exc:
        column = None if exc.pos is None else exc.pos + 1
        raise InvalidGrammarError(GrammarKind.REGEX.value, exc.msg, line=1, column=column) from None
    except RecursionError:  # its parser recurses per nesting level: 4,000 groups deep
        raise InvalidGrammarError(GrammarKind.REGEX.value, "nested too deeply") from None
