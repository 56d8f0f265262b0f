"""The llguidance backend's own error: raised by the adapter and by its tree walks."""

from __future__ import annotations

from espalier.constrained.errors import GrammarError


class MatcherStateError(GrammarError):
    """llguidance hit a resource limit or internal error while matching (not a user token)."""

    reason = "GRAMMAR_STATE_ERROR"
