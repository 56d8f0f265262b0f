"""Incremental detokenization: token ids in, text deltas out, never splitting a UTF-8 character.

Text is built from each token's raw bytes (``TokenizerInfo.token_bytes``, the same bytes the grammar
backends match), fed through an incremental UTF-8 decoder: the trailing bytes of an incomplete
character are held back until the token that completes them arrives. Bytes that can never form a
character become U+FFFD at once. Control tokens (``skip_ids``) contribute no text.

Stop strings: text that could still be the start of a stop string is held back until it is clear
either way. When a stop string appears, the text before it is emitted and the stop string itself
and everything after it are dropped.

The two sides of a served request (``docs/decisions/engine-process.md``): the engine process
finishes a request on a stop string with :class:`StopStringWatch` (the same decoding, no text
kept), the server process makes its text with :class:`IncrementalDetokenizer`
(``engine/output.py``); both see a stop string complete at the same token.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DetokenizedDelta:
    """Result of one :meth:`IncrementalDetokenizer.push`.

    text: new text safe to emit (complete characters, no possible stop-string prefix).
    stop: the stop string that matched, or None.
    """

    text: str
    stop: str | None = None


class IncrementalDetokenizer:
    """Per-request detokenizer state. ``token_bytes[i]`` are the raw bytes of token id ``i``."""

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        *,
        skip_ids: frozenset[int] | set[int] = frozenset(),
        stop: Sequence[str] = (),
    ) -> None:
        self._token_bytes = token_bytes
        self._skip_ids = skip_ids
        self._stops = tuple(s for s in stop if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded but not yet emitted (possible stop-string prefix)
        self._stopped: str | None = None
        self.text = ""  # everything emitted so far

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stopped

    def push(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        """Add tokens; return the text that became final. After a stop, returns empty deltas."""
        if self._stopped is not None:
            return DetokenizedDelta("", None)
        data = _bytes_of(self._token_bytes, self._skip_ids, token_ids)
        self._pending += self._decoder.decode(data)
        return self._emit(final=False)

    def flush(self) -> DetokenizedDelta:
        """The request ended: emit everything held back (an incomplete character becomes U+FFFD)."""
        if self._stopped is not None:
            return DetokenizedDelta("", None)
        self._pending += self._decoder.decode(b"", final=True)
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> DetokenizedDelta:
        pending = self._pending
        if self._stops:
            cut, matched = _earliest_stop(pending, self._stops)
            if matched is not None:
                self._stopped = matched
                self._pending = ""
                return self._take(pending[:cut], matched)
            hold = 0 if final else _longest_stop_prefix_suffix(pending, self._stops)
        else:
            hold = 0
        emit = pending[: len(pending) - hold]
        self._pending = pending[len(emit) :]
        return self._take(emit, None)

    def _take(self, text: str, stop: str | None) -> DetokenizedDelta:
        self.text += text
        return DetokenizedDelta(text, stop)


class StopStringWatch:
    """Whether a stop string has appeared in the text of the tokens pushed so far, without
    building that text: the engine's stop-string decision (its server makes the text).

    Decodes as :class:`IncrementalDetokenizer` does (same bytes, same UTF-8 decoder, same
    ``skip_ids``) and keeps only the last ``max(len(stop)) - 1`` characters, so :meth:`push`
    is True exactly when the detokenizer's ``push`` of the same tokens reports a stop.
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        *,
        skip_ids: frozenset[int] | set[int] = frozenset(),
        stop: Sequence[str],
    ) -> None:
        self._token_bytes = token_bytes
        self._skip_ids = skip_ids
        self._stops = tuple(s for s in stop if s)
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tail = ""  # the text's last ``_keep`` characters

    def push(self, token_ids: Sequence[int]) -> bool:
        """Add tokens; True once a stop string has completed (the request ends here)."""
        data = _bytes_of(self._token_bytes, self._skip_ids, token_ids)
        text = self._tail + self._decoder.decode(data)
        if any(stop in text for stop in self._stops):
            return True
        self._tail = text[len(text) - self._keep :] if self._keep else ""
        return False


def _bytes_of(
    token_bytes: Sequence[bytes], skip_ids: frozenset[int] | set[int], token_ids: Sequence[int]
) -> bytes:
    """The raw bytes of ``token_ids``: control tokens and ids out of range give none."""
    n = len(token_bytes)
    return b"".join(token_bytes[t] for t in token_ids if t not in skip_ids and 0 <= t < n)


def _earliest_stop(text: str, stops: Sequence[str]) -> tuple[int, str | None]:
    """The stop string that completes first (smallest end; then earliest start) and its start.

    Ending first is what streaming one token at a time would see, so pushing many tokens at once
    stops at the same place.
    """
    best_end, best_start, matched = len(text) + 1, len(text), None
    for stop in stops:
        i = text.find(stop)
        if i == -1:
            continue
        end = i + len(stop)
        if end < best_end or (end == best_end and i < best_start):
            best_end, best_start, matched = end, i, stop
    return best_start, matched


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
