"""A C-API twin of a request's llguidance matcher, and how it catches up with the request.

The native tree walk (``traverse_llguidance``) runs on C-API matchers, not on the request's
``LLMatcher``. Each request keeps up to two twins (the second walks part of a big tree on a
second thread). A twin is not advanced as the request decodes: a walk first rolls it back to
where it still agrees with the request's history and consumes the rest, then walks, and leaves
it where the walk ended (the last path it took). The next step usually accepts a prefix of that
path, which the twin then keeps instead of consuming it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from espalier.constrained.native.llguidance import NativeMatcher


@dataclass
class Twin:
    """One C-API matcher following a request.

    Attributes:
        native: the C-API matcher.
        length: tokens it has consumed.
        agree: how many of the first of those are the request's history (``history[:agree]``).
        tail: the path its last walk ended on (its last ``len(tail)`` tokens).
        memo_stale: its mask memo may describe a rolled-back branch (``backends/llguidance``).
        rows_filled: rows of tree masks it has filled (all its walks).
    """

    native: NativeMatcher
    length: int = 0
    agree: int = 0
    tail: list[int] = field(default_factory=list)
    memo_stale: bool = False
    rows_filled: int = 0

    def catch_up(self, history: Sequence[int]) -> tuple[int, list[int]]:
        """``(rollback_n, sync)``: roll back ``rollback_n`` tokens, then consume ``sync``, to be
        at ``history``'s end. The part of the last walk's path the request accepted is kept."""
        agree = self.agree
        base = self.length - len(self.tail)
        if self.tail and agree == base:
            for token, accepted in zip(self.tail, history[base:]):
                if token != accepted:
                    break
                agree += 1
        return self.length - agree, list(history[agree:])

    def ended(self, history_len: int, path: list[int], memo_stale: bool, filled: int) -> None:
        """A walk from ``history``'s end left the twin ``path`` further on, after filling
        ``filled`` rows."""
        self.rows_filled += filled
        self.agree = history_len
        self.length = history_len + len(path)
        self.tail = path
        self.memo_stale = memo_stale

    def forget_after(self, history_len: int) -> None:
        """The request rolled back to ``history_len`` tokens."""
        self.agree = min(self.agree, history_len)
