"""Refuse, at compile time, a grammar whose language is empty: ``root ::= root``, ``start: start``,
``{"$ref": "#"}``, ``a -> b -> a`` ref cycles.

Such a grammar compiles on some backends, and then its first mask allows nothing but a stop token
that the grammar itself would not accept: generation fails on its first token. The check asks the
backend's own matcher, so it holds for every kind and backend: at the start state either the empty
output is accepted, or some non-stop token is allowed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from espalier.constrained import bitmask
from espalier.constrained.errors import GrammarError, InvalidGrammarError

if TYPE_CHECKING:
    from espalier.constrained.base import CompiledGrammar
    from espalier.constrained.tokenizer import TokenizerInfo

EMPTY_LANGUAGE = (
    "the grammar matches no text at all: its start rule never reaches a terminal (a rule or $ref"
    " that only refers to itself, or a cycle of them)"
)


def refuse_empty_language(compiled: CompiledGrammar, tokenizer: TokenizerInfo) -> None:
    """Raise InvalidGrammarError when ``compiled`` admits no output (one mask row, CPU)."""
    kind = compiled.spec.kind.value
    matcher = compiled.matcher()
    try:
        if matcher.can_terminate():
            return
        row = bitmask.allocate(1, tokenizer.vocab_size, fill=0)
        matcher.fill_bitmask(row, 0)
    except GrammarError as exc:
        if exc.reason == "GRAMMAR_STATE_ERROR":  # a backend's limit, not an empty language
            raise InvalidGrammarError(
                kind, f"the backend could not compute the grammar's first mask: {exc}"
            ) from exc
        raise InvalidGrammarError(kind, f"{EMPTY_LANGUAGE} ({exc})") from exc
    allowed = bitmask.unpack_allowed(row[0], tokenizer.vocab_size)
    allowed[list(tokenizer.stop_token_ids)] = False
    if not allowed.any():
        raise InvalidGrammarError(kind, EMPTY_LANGUAGE)
