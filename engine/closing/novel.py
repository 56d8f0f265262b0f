"""Closing paths out of an open run: the walk that prefers tokens leading to an unseen row.

Where the greedy search and :mod:`backtrack` find no path, the state is often inside a run the
greedy walk cannot leave: a string whose end needs one particular character first
(``format: email`` needs ``@`` then a ``.``, ``^[a-z]*y$`` a ``y``, a ``duration`` a designator
after its digits). The greedy walk takes the lowest allowed token, which goes round the run.

:meth:`NovelWalk.find` walks from the state and, where nothing is forced, tries the tokens the
greedy search would (its candidates, then the lowest allowed ids, whitespace last) and takes the
first after which the grammar's row is one this walk has not seen yet: a step out of the run
(``@`` ends the local part: its row differs from every row the local part had). Where no token
leads to an unseen row, it takes the first accepted one (the greedy choice). A token used that
way does not make progress, so a run where every choice goes back to seen rows ends at the
limit: the walk reaches what one character at a time can reach (not ``\\.json$``, whose end
needs four characters whose rows all look alike).

Cost: at most :data:`TRIES` grammar steps (a fork, an accept, a row fill) per walk, a count, not
a clock: the path is a function of the state. Exact: every token was accepted on the walk's own
fork and the path ends where ``can_terminate()``.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from espalier.engine.closing import LOWEST_ALLOWED, _lowest_allowed
from espalier.engine.closing.backtrack import _bit

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarMatcher
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.closing import ClosingPaths

TRIES = 2048
"""Grammar steps per walk (each a fork, an accept and a row fill: tens of µs on Gemma)."""


class NovelWalk:
    """The closing fallback of last resort (module docstring), for one :class:`ClosingPaths`."""

    def __init__(self, paths: ClosingPaths, tokenizer: TokenizerInfo) -> None:
        self.paths = paths
        self.tokenizer = tokenizer
        self._single_bytes: list[int] | None = None

    @property
    def single_bytes(self) -> list[int]:
        """One id per byte value (the lowest), in byte order: every character one step away,
        where the lowest allowed ids of a free-text state are 64 control and byte tokens. A
        pass over the vocabulary, made at the first walk and kept per tokenizer (the walk runs
        only where every other search failed: not at engine start)."""
        if self._single_bytes is None:
            self._single_bytes = self.tokenizer.backend_view(
                "espalier.engine.closing.single_bytes", _single_bytes
            )
        return self._single_bytes

    def find(self, matcher: GrammarMatcher, limit: int) -> list[int] | None:
        """Tokens (at most ``limit``) after which ``matcher`` (not changed) can terminate;
        None: not found within ``limit`` tokens or :data:`TRIES` steps."""
        probe = matcher.fork()
        path: list[int] = []
        seen = {self._signature(probe)}
        tries = 0
        while not probe.can_terminate():
            if len(path) >= limit or tries >= TRIES:
                return None
            forced = probe.forced_tokens(limit - len(path))
            taken = probe.accept_tokens(forced) if forced else 0
            if taken:
                path.extend(forced[:taken])
                seen.add(self._signature(probe))
                continue
            first: int | None = None
            chosen: tuple[int, GrammarMatcher] | None = None
            for token in self._choices(probe):
                if tries >= TRIES:
                    break
                tries += 1
                after = probe.fork()
                if not after.accept(token):
                    continue
                if first is None:
                    first = token
                signature = self._signature(after)
                if signature not in seen:
                    seen.add(signature)
                    chosen = (token, after)
                    break
            if chosen is None:
                if first is None:
                    return None
                accepted = probe.accept(first)
                assert accepted, "a fork accepted it"
                path.append(first)
                continue
            path.append(chosen[0])
            probe = chosen[1]
        return path

    def _choices(self, probe: GrammarMatcher) -> list[int]:
        """The greedy search's candidates, the lowest allowed ids (whitespace last), then the
        allowed one-byte tokens in byte order."""
        paths = self.paths
        row = paths._row()
        probe.fill_bitmask(row, 0)
        lowest = _lowest_allowed(row[0].numpy(), LOWEST_ALLOWED)
        allowed = [t for t in lowest if t not in paths.stops]
        words = row[0].numpy()
        candidates = [t for t in paths.candidates if _bit(words, t)]
        rest = [t for t in allowed if t not in candidates]
        ordered = (
            candidates
            + [t for t in rest if t not in paths.blank]
            + [t for t in rest if t in paths.blank]
        )
        listed = set(ordered)
        ordered += [t for t in self.single_bytes if t not in listed and _bit(words, t)]
        return ordered

    def _signature(self, probe: GrammarMatcher) -> bytes:
        """The row ``probe`` allows and whether it may end there, as one digest."""
        row = self.paths._row()
        probe.fill_bitmask(row, 0)
        digest = hashlib.blake2b(row[0].numpy().tobytes(), digest_size=16)
        digest.update(b"1" if probe.can_terminate() else b"0")
        return digest.digest()


def _single_bytes(tokenizer: TokenizerInfo) -> list[int]:
    stops = frozenset(tokenizer.stop_token_ids)
    ids: dict[bytes, int] = {}
    for i, data in enumerate(tokenizer.token_bytes):
        if len(data) == 1 and data not in ids and i not in stops:
            ids[data] = i
    return [ids[b] for b in sorted(ids)]
