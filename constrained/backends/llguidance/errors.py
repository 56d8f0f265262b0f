"""The llguidance backend's own error: raised by the adapter and by its tree walks."""

from __future__ import annotations

from espalier.constrained.errors import GrammarError

MAX_DETAIL = 300
"""Characters of llguidance's message kept: its first line names the limit; what follows is
the parser's state (tokens, lexer costs, rows), internals that say nothing to the caller."""


class MatcherStateError(GrammarError):
    """llguidance hit a resource limit or internal error while matching (not a user token):
    its grammar grew past what the lexer or parser may build at this point (a huge repetition
    count, e.g. ``a{1000000}``). The message is llguidance's first line only."""

    reason = "GRAMMAR_STATE_ERROR"

    def __init__(self, message: str) -> None:
        lines = message.strip().splitlines()
        first = lines[0] if lines else "llguidance stopped"
        if len(first) > MAX_DETAIL:
            first = first[:MAX_DETAIL] + "..."
        super().__init__(f"{first} (the grammar is too complex for llguidance here)")
