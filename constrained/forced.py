"""Tokens the grammar forces from a matcher's state, checked, for the drafter to put in trees."""

from __future__ import annotations

from espalier.constrained.base import GrammarMatcher


def forced_tokens(matcher: GrammarMatcher, limit: int) -> list[int]:
    """Up to ``limit`` tokens the grammar forces next (canonical tokenization), possibly ``[]``.

    Delegates to ``matcher.forced_tokens`` (llguidance fast-forward tokens, xgrammar's jump-forward
    string re-tokenized, outlines-core single-successor states) and keeps the longest prefix the
    matcher actually accepts, so a drafter never proposes a chain the grammar rejects. The matcher
    is left in the state it was in.
    """
    if limit <= 0:
        return []
    chain = matcher.forced_tokens(limit)[:limit]
    accepted = 0
    for token in chain:
        if not matcher.accept(token):
            break
        accepted += 1
    matcher.rollback(accepted)
    return list(chain[:accepted])
