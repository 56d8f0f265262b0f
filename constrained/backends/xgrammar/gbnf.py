"""GBNF text as llama.cpp reads it, respelled where xgrammar's EBNF parser reads it otherwise.

xgrammar takes GBNF directly (a grammar over characters, as llama.cpp's), but four spellings
differ (checked on xgrammar 0.2.9, ``tests/constrained/test_gbnf_reading.py``):

- ``\\xHH`` reads on past two hex digits: ``"\\x41BC"`` is U+41BC there, ``ABC`` in llama.cpp.
  It is written ``\\u00HH`` (xgrammar reads ``\\u`` and ``\\U`` as llama.cpp does); a ``\\x``
  with fewer than two hex digits is refused, as llama.cpp refuses it.
- An empty alternative (``ws ::= | " "``, ``( | "x")``, llama.cpp's ``json.gbnf``) is a parse
  error there: it is written ``""``.
- ``.`` (any character) is a parse error there: it is written ``[\\u0000-\\U0010FFFF]``.
- ``\\[`` and ``\\]`` in a literal are refused there ("Invalid escape sequence"): they are
  written ``[`` and ``]``.
"""

from __future__ import annotations

import re

from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.gbnf import TOKEN

_HEX_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{0,2})|.)", re.DOTALL)
_SKIPPED = ("space", "comment")
ANY_CHARACTER = "[\\u0000-\\U0010FFFF]"


def xgrammar_gbnf(source: str) -> str:
    """``source`` (GBNF) respelled so that xgrammar reads the language llama.cpp does; raises
    InvalidGrammarError (with its line) for a ``\\x`` escape without two hex digits."""
    tokens = [(m.lastgroup or "other", m.group(), m.start()) for m in TOKEN.finditer(source)]
    out: list[str] = []
    last = 0  # len(out) after the last token that is not space or a comment
    has = True  # whether the current alternative holds an element (outside a rule: nothing due)

    def empty() -> None:  # an empty alternative ends here: ``""`` after its last token
        out.insert(last, ' ""')

    for i, (kind, text, start) in enumerate(tokens):
        if kind == "name" and _defines(tokens, i):
            if not has:
                empty()
            has = True  # the head; its ``::=`` opens the body
        elif kind == "define":
            has = False
        elif kind in ("bar", "close"):
            if not has:
                empty()
            has = kind == "close"  # a closed group is an element of the alternative around it
        elif kind == "open":
            has = False
        elif kind in ("lit", "cls"):
            text = _escapes(text, source, start, kind == "lit")
            has = True
        elif kind == "dot":
            text, has = ANY_CHARACTER, True
        elif kind == "name":
            has = True
        out.append(text)
        if kind not in _SKIPPED:
            last = len(out)
    if not has:
        empty()
    return "".join(out)


def _defines(tokens: list[tuple[str, str, int]], i: int) -> bool:
    """Whether the name at ``tokens[i]`` is a rule's head (``::=`` follows it)."""
    for kind, _, _ in tokens[i + 1 :]:
        if kind not in _SKIPPED:
            return kind == "define"
    return False


def _escapes(text: str, source: str, start: int, literal: bool) -> str:
    """A literal's or a class's ``\\xHH`` escapes written ``\\u00HH``; a literal's ``\\[``
    and ``\\]`` written bare."""

    def respell(match: re.Match[str]) -> str:
        digits, escape = match.group(1), match.group()
        if digits is None:
            return escape[1] if literal and escape in ("\\[", "\\]") else escape
        if len(digits) < 2:
            line = source.count("\n", 0, start + match.start()) + 1
            raise InvalidGrammarError(
                "ebnf", "a \\x escape needs two hex digits (\\xHH)", line=line
            )
        return "\\u00" + digits

    return _HEX_ESCAPE.sub(respell, text)
