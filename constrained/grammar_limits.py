"""Size limits of a grammar text that hold for every backend, checked before it is compiled.

llguidance's Earley parser fails a request mid-generation once one row holds more than 2,000 items
(a Lark or GBNF rule with ~2,000 alternatives, a ``choice`` with ~2,000 options; its own JSON
schema compiler turns ``enum`` into one lexeme and is not affected). Counting alternatives up
front turns that into an INVALID_ARGUMENT before the request is admitted.
"""

from __future__ import annotations

import re

from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.spec import GrammarKind, GrammarSpec

DEFAULT_MAX_ALTERNATIVES = 1024
"""Alternatives (``|``) in one Lark or GBNF grammar; real grammars (the Lark and GBNF files of
``conformance/grammars``) use at most 421, llguidance fails near 2,000 in one rule."""

# What a `|` inside is not an alternative: string literals, character classes, comments and (Lark)
# regex literals. GBNF comments start with '#', Lark comments with '//'.
_SKIP = {
    GrammarKind.EBNF: re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*', re.DOTALL),
    GrammarKind.LARK: re.compile(
        r'"(?:[^"\\]|\\.)*"|//[^\n]*|/(?![/\s])(?:[^/\\\n]|\\.)+/[imslux]*', re.DOTALL
    ),
}


def count_alternatives(spec: GrammarSpec) -> int:
    """Alternatives of a grammar: ``|`` operators for Lark / GBNF, options for a choice."""
    if spec.kind is GrammarKind.CHOICE:
        return len(spec.choices)
    skip = _SKIP.get(spec.kind)
    if skip is None:
        return 0
    return skip.sub(" ", spec.source).count("|")


def check_alternatives(spec: GrammarSpec, limit: int = DEFAULT_MAX_ALTERNATIVES) -> None:
    """Raise InvalidGrammarError when ``spec`` has more than ``limit`` alternatives."""
    found = count_alternatives(spec)
    if found > limit:
        what = "options" if spec.kind is GrammarKind.CHOICE else "alternatives ('|')"
        raise InvalidGrammarError(
            spec.kind.value, f"the grammar has {found} {what}, over the limit of {limit}"
        )
