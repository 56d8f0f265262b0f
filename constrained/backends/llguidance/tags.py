"""Structural tags as llguidance grammars: Lark with ``%json``, lazy lexemes and side grammars.

Only formats whose llguidance form matches exactly the text xgrammar's structural tag matches
are translated; any other raises :class:`UnsupportedGrammarError` (the front door then tries the
next backend, or refuses). Translated:

- ``const_string`` → a string literal; ``json_schema`` (style ``json``, no ``any_order`` /
  ``excludes``) → ``%json`` with the backend's JSON options; ``regex`` → ``/.../``;
  ``grammar`` (Lark, or GBNF through llguidance's converter) → a side grammar ``@gN``;
- ``sequence`` / ``or`` → concatenation / alternation;
- ``tag`` with string ``begin`` / ``end``; when its content is ``any_text`` (no limits), a lazy
  rule: any text up to the first end string, which ends it;
- ``any_text`` (no limits) and ``triggered_tags`` (no ``excludes`` / ``at_least_one`` /
  ``stop_after_first``) where nothing follows them: free text that contains no trigger, and at
  each trigger's first occurrence (a lazy rule: text without a trigger, then the trigger) one of
  the tags that begin with it.

Free text here is UTF-8 text; xgrammar's ``any_text`` also admits bytes that never form UTF-8
(a lone ``0x80``), so on byte-level vocabularies its free-text masks allow a few tokens more.
"""

from __future__ import annotations

import json
from typing import Any

from espalier.constrained.backends.llguidance import gbnf_lexing
from espalier.constrained.errors import UnsupportedGrammarError
from espalier.constrained.regex_dialect import (
    in_lark_terminals,
    lark_token_reference,
    own_common_terminals,
    rust_misreading,
)
from espalier.constrained.schema.number_bounds import NumberBounds, bound_schema_numbers
from espalier.constrained.spec import BackendName, GrammarSpec
from espalier.constrained.structural_tag import Format, json_whitespace, root_format

NAME = BackendName.LLGUIDANCE
_ANY = r"/(?s:.*)/"


def structural_tag_grammar(
    spec: GrammarSpec, json_options: dict[str, Any], ws: int, bounds: NumberBounds | None
) -> str:
    """The llguidance top-level grammar (JSON text) for a STRUCTURAL_TAG ``spec``.

    ``json_options``: the ``x-guidance`` options of the backend's JSON (whitespace is set per
    node from ``ws``, the backend's default bound, see ``structural_tag.json_whitespace``);
    ``bounds``: the number bounds added to each schema (None: unbounded).
    """
    builder = _Builder(json_options, ws, bounds)
    start = builder.expr(root_format(spec), at_end=True)
    lark = "\n".join([f"start: {start}", *builder.rules])
    grammars = [{"lark_grammar": lark}, *builder.side]
    return json.dumps({"grammars": grammars}, ensure_ascii=False)


class _Builder:
    def __init__(self, json_options: dict[str, Any], ws: int, bounds: NumberBounds | None) -> None:
        self.json_options = json_options
        self.ws = ws
        self.bounds = bounds
        self.rules: list[str] = []
        self.side: list[dict[str, str]] = []

    def rule(self, head: str, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{head}: {body}")
        return name

    def expr(self, fmt: Format, *, at_end: bool) -> str:
        kind = fmt.get("type")
        method = getattr(self, f"_{kind}", None)
        if method is None:
            raise _unsupported(f"format {kind!r}")
        result: str = method(fmt, at_end)
        return result

    def _const_string(self, fmt: Format, at_end: bool) -> str:
        return _literal(fmt["value"])

    def _json_schema(self, fmt: Format, at_end: bool) -> str:
        if fmt.get("style", "json") != "json" or fmt.get("any_order") or fmt.get("excludes"):
            raise _unsupported("json_schema with a style, any_order or excludes")
        schema = fmt["json_schema"]
        schema = {} if schema is True else schema
        if not isinstance(schema, dict):
            raise _unsupported("a false JSON schema")
        if self.bounds is not None:
            schema = bound_schema_numbers(schema, NAME, self.bounds)
        options = dict(self.json_options)
        count = json_whitespace(fmt, self.ws)
        options.update(
            whitespace_flexible=True, whitespace_pattern=rf"[\x20\x0A\x0D\x09]{{0,{count}}}"
        )
        options.pop("item_separator", None)
        options.pop("key_separator", None)
        return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)

    def _regex(self, fmt: Format, at_end: bool) -> str:
        pattern = str(fmt["pattern"])
        misread = rust_misreading(pattern)  # as for a regex constraint (regex_dialect)
        if misread is not None:
            raise UnsupportedGrammarError(NAME, "structural_tag", f"llguidance reads {misread}")
        return "/" + (pattern.replace("/", "\\/") or "(?:)") + "/"  # "//" starts a comment

    def _grammar(self, fmt: Format, at_end: bool) -> str:
        text = str(fmt["grammar"])
        if fmt.get("syntax", "ebnf") == "ebnf":
            try:
                text = gbnf_lexing.lark_of(text)
            except Exception as exc:  # the converter raises assorted errors on bad input
                raise _unsupported(f"GBNF the converter refuses ({exc})") from exc
            reason = gbnf_lexing.refusal(str(fmt["grammar"]))
            if reason is not None:
                raise _unsupported(f"a GBNF element: {reason}")
        else:
            misread = in_lark_terminals(text, rust_misreading)
            if misread is not None:
                raise _unsupported(f"a Lark element: llguidance reads {misread}")
            reference = lark_token_reference(text)
            if reference is not None:
                raise _unsupported(f"a Lark element's token reference ({reference})")
            text = own_common_terminals(text)
        name = f"g{len(self.side)}"
        self.side.append({"name": name, "lark_grammar": text})
        return "@" + name

    def _sequence(self, fmt: Format, at_end: bool) -> str:
        elements = fmt["elements"]
        last = len(elements) - 1
        parts = [self.expr(e, at_end=at_end and i == last) for i, e in enumerate(elements)]
        return "(" + " ".join(parts) + ")"

    def _or(self, fmt: Format, at_end: bool) -> str:
        return "(" + " | ".join(self.expr(e, at_end=at_end) for e in fmt["elements"]) + ")"

    def _tag(self, fmt: Format, at_end: bool) -> str:
        begin, end = fmt["begin"], fmt["end"]
        if not isinstance(begin, str) or isinstance(end, dict):
            raise _unsupported("a tag with a token begin or end")
        ends = [end] if isinstance(end, str) else list(end)
        end_expr = "(" + " | ".join(_literal(e) for e in ends) + ")"
        content = fmt["content"]
        if content.get("type") == "any_text":
            _plain_text(content)
            if not all(ends):
                raise _unsupported("free text in a tag with an empty end")
            return f"({_literal(begin)} {self.rule('[lazy]', f'{_ANY} {end_expr}')})"
        return f"({_literal(begin)} {self.expr(content, at_end=False)} {end_expr})"

    def _any_text(self, fmt: Format, at_end: bool) -> str:
        _plain_text(fmt)
        if not at_end:
            raise _unsupported("any_text followed by more output")
        return _ANY

    def _triggered_tags(self, fmt: Format, at_end: bool) -> str:
        if fmt.get("excludes") or fmt.get("at_least_one") or fmt.get("stop_after_first"):
            raise _unsupported("triggered_tags with excludes, at_least_one or stop_after_first")
        if not at_end:
            raise _unsupported("triggered_tags followed by more output")
        triggers = [str(t) for t in fmt["triggers"]]
        if not triggers or not all(triggers):
            raise _unsupported("triggered_tags without (non-empty) triggers")
        no_trigger = "/(?s:.*(" + "|".join(_regex_escape(t) for t in triggers) + ").*)/"
        free_token = f"FREE{len(self.rules)}"  # a token: `&` and `~` combine lexemes only
        self.rules.append(f"{free_token}: {_ANY} & ~{no_trigger}")
        segments = []
        for trigger in triggers:
            bodies = []
            for tag in fmt["tags"]:
                begin = tag.get("begin")
                if isinstance(begin, str) and begin.startswith(trigger):
                    rest = {**tag, "begin": begin[len(trigger) :]}
                    bodies.append(self._tag(rest, False))
            if bodies:
                head = self.rule("[lazy]", f"{free_token} {_literal(trigger)}")
                segments.append(f"({head} ({' | '.join(bodies)}))")
        return f"({' | '.join(segments)})* {free_token}" if segments else free_token


def _plain_text(fmt: Format) -> None:
    if fmt.get("excludes") or fmt.get("max_tokens") is not None or fmt.get("max_chars"):
        raise _unsupported("any_text with excludes or a length limit")


def _literal(text: str) -> str:
    """A Lark string literal (JSON escapes; DEL escaped too: the Lark lexer refuses it raw)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _regex_escape(text: str) -> str:
    out = []
    for char in text:
        if ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append("\\" + char if char in r"\.^$|?*+()[]{}/-" else char)
    return "".join(out)


def _unsupported(what: str) -> UnsupportedGrammarError:
    return UnsupportedGrammarError(NAME, "structural_tag", f"{what} has no exact llguidance form")
