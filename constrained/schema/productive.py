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
from espalier.constrained.errors import FirstMaskLimitError, GrammarError, InvalidGrammarError

if TYPE_CHECKING:
    from espalier.constrained.base import CompiledGrammar
    from espalier.constrained.tokenizer import TokenizerInfo

EMPTY_LANGUAGE = (
    "the grammar matches no text at all: its start rule never reaches a terminal (a rule or $ref"
    " that only refers to itself, or a cycle of them)"
)


def refuse_empty_language(compiled: CompiledGrammar, tokenizer: TokenizerInfo) -> None:
    """Raise InvalidGrammarError when ``compiled`` admits no output (one mask row, CPU). For a
    constraint after a reasoning marker (``structural_tag.after_reasoning``) the grammar after
    the marker is checked too: the free text before it always admits output."""
    from espalier.constrained.structural_tag import reasoning_end

    _refuse_empty_from(compiled, tokenizer, ())
    marker = reasoning_end(compiled.spec)
    if marker is not None:
        _refuse_empty_from(compiled, tokenizer, tokenizer.encode_text(marker))


def _refuse_empty_from(
    compiled: CompiledGrammar, tokenizer: TokenizerInfo, prefix: list[int] | tuple[int, ...]
) -> None:
    """:func:`refuse_empty_language` at the state after ``prefix`` (a reasoning end marker's
    tokens; not taken: no check)."""
    kind = compiled.spec.kind.value
    after = "after the reasoning end marker, " if prefix else ""
    matcher = compiled.matcher()
    try:
        if prefix and matcher.accept_tokens(list(prefix)) < len(prefix):
            return  # the marker's spelling is not taken here: not this check's to judge
        if matcher.can_terminate():
            return
        row = bitmask.allocate(1, tokenizer.vocab_size, fill=0)
        matcher.fill_bitmask(row, 0)
    except GrammarError as exc:
        # at the start a backend's limit is not an empty language; after the marker the
        # backends stop this way on a grammar that admits nothing (llguidance: NoExtensionBias)
        if exc.reason == "GRAMMAR_STATE_ERROR" and not prefix:
            raise FirstMaskLimitError(
                kind, f"the backend could not compute the grammar's first mask: {exc}"
            ) from exc
        raise InvalidGrammarError(kind, f"{after}{EMPTY_LANGUAGE} ({exc})") from exc
    allowed = bitmask.unpack_allowed(row[0], tokenizer.vocab_size)
    allowed[list(tokenizer.stop_token_ids)] = False
    if not allowed.any():
        raise InvalidGrammarError(kind, f"{after}{EMPTY_LANGUAGE}")
