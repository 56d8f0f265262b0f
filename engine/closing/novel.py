"""Closing paths out of an open run: the walk that prefers tokens leading to an unseen row.

Where the greedy search and :mod:`backtrack` find no path, the state is often inside a run the
greedy walk cannot leave: a string whose end needs one particular character first
(``format: email`` needs ``@`` then a ``.``, ``^[a-z]*y$`` a ``y``, a ``duration`` a designator
after its digits). The greedy walk takes the lowest allowed token, which goes round the run.

:meth:`NovelWalk.find` walks from the state and, where nothing is forced, tries the tokens the
greedy search would (its candidates, then the lowest allowed ids, whitespace last) and takes the
first after which the grammar's row is one this walk has not seen yet: a step out of the run
(``@`` ends the local part: its row differs from every row the local part had). Where no token
leads to an unseen row, it takes the first accepted one (the greedy choice), and a later state
with that same row (and end) takes it at once, without trying the choices again: inside a run
whose rows all look alike (a string under ``minLength: 1000``) one scan is made, not one per
character. A token used that way does not make progress, so a run where every choice goes back
to seen rows ends at the limit: the walk reaches what one character at a time can reach (not
``\\.json$``, whose end needs four characters whose rows all look alike).

Cost: at most :data:`TRIES` grammar steps (a fork, an accept, a row fill) per walk, a count, not
a clock: the path is a function of the state. A walk that finds nothing (a state no path within
the budget closes) costs one scan of the choices plus a step per token of the limit, not
:data:`TRIES` steps: it runs on the engine's threads, and a request that cannot close within
its budget must not hold up the others (10 such requests took the engine 7.5 s). Exact: every
token was accepted on the walk's own fork and the path ends where ``can_terminate()``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

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
        """One id per ASCII byte value (the lowest), in byte order: every character one step away,
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
        words, signature = self._row(probe)
        seen = {signature}
        scanned: set[bytes] = set()  # rows where no choice led to an unseen row
        tries = 0
        while not probe.can_terminate():
            if len(path) >= limit or tries >= TRIES:
                return None
            forced = probe.forced_tokens(limit - len(path))
            taken = probe.accept_tokens(forced) if forced else 0
            if taken:
                path.extend(forced[:taken])
                words, signature = self._row(probe)
                seen.add(signature)
                continue
            first: int | None = None
            chosen: tuple[int, GrammarMatcher] | None = None
            choices = self._choices(words)
            if signature in scanned:  # the choices lead back to seen rows, as there
                tries += 1
                first = next((t for t in choices if probe.fork().accept(t)), None)
                choices = iter(())
            for token in choices:
                if tries >= TRIES:
                    break
                tries += 1
                after = probe.fork()
                if not after.accept(token):
                    continue
                if first is None:
                    first = token
                after_words, after_signature = self._row(after)
                if after_signature not in seen:
                    seen.add(after_signature)
                    chosen = (token, after)
                    words, signature = after_words, after_signature
                    break
            if chosen is None:
                if first is None:
                    return None
                scanned.add(signature)
                accepted = probe.accept(first)
                assert accepted, "a fork accepted it"
                path.append(first)
                words, signature = self._row(probe)
                seen.add(signature)
                continue
            path.append(chosen[0])
            probe = chosen[1]
        return path

    def _choices(self, words: np.ndarray) -> Iterator[int]:
        """The greedy search's candidates, the lowest allowed ids (whitespace last), then the
        allowed one-byte tokens in byte order, of the state whose row is ``words`` (made as
        taken: a step that takes the first needs no more); only tokens of whole UTF-8
        characters: a lead byte's row (continuations only) is unseen once per kind of lead,
        and the walk spent its steps there, never on an exit."""
        paths = self.paths
        candidates = [t for t in paths.candidates if _bit(words, t)]
        yield from candidates
        lowest = _lowest_allowed(words, LOWEST_ALLOWED)
        rest = [t for t in lowest if t not in paths.stops and t not in candidates]
        rest = [t for t in rest if self._whole(t)]
        yield from (t for t in rest if t not in paths.blank)
        yield from (t for t in rest if t in paths.blank)
        listed = {*candidates, *rest}
        yield from (t for t in self.single_bytes if t not in listed and _bit(words, t))

    def _whole(self, token: int) -> bool:
        try:
            self.tokenizer.token_bytes[token].decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    def _row(self, probe: GrammarMatcher) -> tuple[np.ndarray, bytes]:
        """The row ``probe`` allows (int32 ``[W]``, a copy) and, as one digest, that row and
        whether it may end there."""
        row = self.paths._row()
        probe.fill_bitmask(row, 0)
        words: np.ndarray = row[0].numpy().copy()
        digest = hashlib.blake2b(words.tobytes(), digest_size=16)
        digest.update(b"1" if probe.can_terminate() else b"0")
        return words, digest.digest()


def _single_bytes(tokenizer: TokenizerInfo) -> list[int]:
    stops = frozenset(tokenizer.stop_token_ids)
    ids: dict[bytes, int] = {}
    for i, data in enumerate(tokenizer.token_bytes):
        if len(data) == 1 and data[0] < 0x80 and data not in ids and i not in stops:
            ids[data] = i
    return [ids[b] for b in sorted(ids)]
