"""Closing paths where the greedy search finds none: keys chosen latest first, and backtracking.

:meth:`ClosingPaths.search <espalier.engine.closing.ClosingPaths.search>` takes the lowest
allowed token wherever nothing is forced. In an object that ``}`` cannot close yet (required
keys remain) that writes the next *optional* key in declared order before the required ones:
each one a value more to close, some of them strings the greedy walk cannot end (``pattern``
``^file:.+\\.km[lz]$``: it takes ``}`` as content), so it finds no path where a short one exists
(Github_medium/o90224: ``{"id":"","layerType":"KML","title":"","url":""}``).

:meth:`Backtracking.find` walks like the greedy search (forced tokens, then the greedy's own
choice) and differs at two kinds of choice:

- **a key** (the ``"`` that the greedy takes after ``{`` or ``,``; ``}`` was refused there, so
  required keys remain): the keys allowed there are listed (a trie of the texts the masks allow,
  from each node's longest tokens; no list where a node allows more than :data:`KEY_BRANCHES`
  tokens: free text) and tried in :meth:`_Search._rank` order: first a key after which a minimal
  value lets ``}`` close the object, then by how few of the others may follow it. In a
  declared-order object the keys allowed are the optional ones up to the next required one, so
  the key tried first skips every optional key;
- **any other choice**, as one of at most :data:`DEPARTURES` departures per path from the
  greedy choice: the other candidates allowed, the lowest allowed whitespace token (a ``\\s`` in
  a pattern: the greedy takes whitespace last) and the lowest other allowed tokens (at most
  :data:`ALTERNATIVES` in all), not inside a run of the greedy's choice (departing at its
  start is that and shorter). Keys after the first count as departures too.

A branch that chooses one token ``REPEAT_LIMIT`` times in a row (closers included) is
dropped. Cost: at most :data:`NODES` grammar steps per call (a forced run, an accepted choice,
a trie node or a ranking check), each a few library calls (fork, accept, mask fill: µs to tens
of µs with llguidance and Gemma's 262k vocabulary). Measured on this project's 2-core CPU under
load: 60-100 ms CPU for a search that spends all its steps (Github_ultra/o80235: no document
fits), 7-75 ms for those that find a path (Github_medium/o90224, Github_hard/o21330,
Github_ultra/o21380, JsonSchemaStore/ruleset_schema); the greedy search that failed first costs
6-47 ms there. It
runs only where the greedy search returns None, and a decision where neither finds a path
checks again ``RETRY_AFTER`` tokens later. A count, not a clock, bounds it, so the
result is a function of the state (decisions stay a function of the tokens). Exact: every
path returned was accepted token by token on forks of the matcher and ends where
``can_terminate()``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from espalier.constrained import bitmask as bm
from espalier.engine.closing import REPEAT_LIMIT, _lowest_allowed

if TYPE_CHECKING:
    import torch

    from espalier.constrained.base import GrammarMatcher
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.closing import ClosingPaths

NODES = 512  # grammar steps per search
DEPARTURES = 2  # choices per path other than the greedy's (or the first-ranked key)
ALTERNATIVES = 4  # departures tried at one choice
KEY_BRANCHES = 160  # a key trie node allowing more tokens than this: free text
KEYS = 24  # more keys than this at one place are not listed (the greedy choice stands)
KEY_BYTES = 64  # nor are keys longer than this
SLACK = 2  # paths up to this many times the limit are searched (then encoded shorter)
MINIMAL_VALUES = ('""', "0", "null", "false", "[]", "{}")  # to see what may follow a key
Option = tuple[int, list[int], "GrammarMatcher"]  # (departures it costs, tokens, matcher after)


class Backtracking:
    """The fallback search for one tokenizer, beside its greedy ``paths`` (thread-safe: each
    call is a :class:`_Search` of its own, each thread has its own scratch row)."""

    def __init__(self, paths: ClosingPaths, tokenizer: TokenizerInfo) -> None:
        self.paths = paths
        self.token_bytes = tokenizer.token_bytes
        self.encode = tokenizer.encode_text
        single = [tokenizer.encode_text(text) for text in (":", ",", "}")]
        self.colon, self.comma, self.brace = (ids[0] if len(ids) == 1 else None for ids in single)
        self.values = [ids for ids in map(tokenizer.encode, MINIMAL_VALUES) if ids]
        self._rows = threading.local()

    def find(self, matcher: GrammarMatcher, prefix: Sequence[int], limit: int) -> list[int] | None:
        """Tokens (at most ``limit``) after ``prefix`` after which ``matcher`` can terminate;
        None if none is found within :data:`NODES` steps (or ``prefix`` is refused).
        ``matcher`` itself is not changed (the search runs on forks)."""
        if limit < 0 or None in (self.paths.quote, self.colon, self.comma):
            return None
        probe = matcher.fork()
        if probe.accept_tokens(prefix) != len(prefix):
            return None
        search = _Search(self, limit, probe, prefix[-1:])
        return search.walk(probe.fork(), [], DEPARTURES)

    def row(self) -> torch.Tensor:
        """This thread's scratch bitmask row (int32 ``[1, ceil(V/32)]``, CPU)."""
        row: torch.Tensor | None = getattr(self._rows, "row", None)
        if row is None:
            row = self._rows.row = bm.allocate(1, self.paths.vocab_size, fill=0)
        return row


class _Search:
    """One :meth:`Backtracking.find` call: its limit, the steps it has left and the token
    before its start (``before``: none known)."""

    def __init__(
        self, owner: Backtracking, limit: int, start: GrammarMatcher, before: Sequence[int] = ()
    ) -> None:
        self.owner = owner
        self.start = start  # the state the search starts from (not advanced)
        self.before = list(before)
        self.paths = owner.paths
        self.limit = limit
        self.reach = SLACK * limit  # a path this long may still be written in fewer tokens
        self.steps = NODES
        self.quote: int = owner.paths.quote  # type: ignore[assignment]

    def walk(self, probe: GrammarMatcher, path: list[int], departures: int) -> list[int] | None:
        """A closing path from ``probe`` (advanced along the first branch) after ``path``:
        forced runs, then each option of :meth:`options` in turn, depth first."""
        while not probe.can_terminate():
            if len(path) >= self.reach or self.steps <= 0:
                return None
            forced = probe.forced_tokens(self.reach - len(path))
            taken = probe.accept_tokens(forced) if forced else 0
            self.steps -= 1
            if taken:
                path = [*path, *forced[:taken]]
                continue
            if _run(path) >= REPEAT_LIMIT:
                return None
            for cost, tokens, child in self.options(probe, path, departures):
                if len(path) + len(tokens) > self.reach:
                    continue
                found = self.walk(child, [*path, *tokens], departures - cost)
                if found is not None:
                    return found
                if self.steps <= 0:
                    break
            return None
        return self._written(path)

    def _written(self, path: list[int]) -> list[int] | None:
        """``path`` or the tokenizer's encoding of its text where the grammar takes that and it
        is shorter (the masks' tokens are often shorter pieces: Github_ultra/o21380's closing
        from its start state is 328 tokens as the walk takes them, 190 encoded); None when
        neither fits the limit."""
        text = b"".join(self.owner.token_bytes[t] for t in path)
        try:
            encoded = self.owner.encode(text.decode())
        except UnicodeDecodeError:
            encoded = path
        self.steps -= 1
        if len(encoded) < len(path) and self.paths.stops.isdisjoint(encoded):
            probe = self.start.fork()
            if probe.accept_tokens(encoded) == len(encoded) and probe.can_terminate():
                path = encoded
        return path if len(path) <= self.limit else None

    def options(self, probe: GrammarMatcher, path: list[int], departures: int) -> Iterator[Option]:
        """The choices at ``probe``'s state (``path``: the tokens the search took to reach it),
        best first; each matcher a fork (``probe`` is not changed). Lazy: the listing stops
        where a branch closes."""
        chosen = probe.fork()
        token = self.paths._first_accepted(chosen)
        if token is None:
            return
        if token == self.quote and self._at_key(path):
            keys = self._keys(chosen)
            if keys:
                for k, (tokens, after) in enumerate(self._rank(keys)):
                    if k and not departures:
                        return
                    yield (min(k, 1), *self._shortened(probe, tokens, after))
                return
        yield 0, [token], chosen
        if departures and (not path or path[-1] != token):  # a run departs at its start only
            for other in self._alternatives(probe, token):
                child = probe.fork()
                self.steps -= 1
                if child.accept(other):
                    yield 1, [other], child

    def _at_key(self, path: list[int]) -> bool:
        """Whether a ``"`` taken after ``path`` may open a key: after ``{`` or ``,`` (an
        array's ``,`` too: its strings then list as no key), or where the text before is
        not known (the start of a search without a prefix)."""
        for token in reversed([*self.before, *path]):
            text = self.owner.token_bytes[token].strip()
            if text:
                return text[-1:] in (b"{", b",")
        return not self.before

    def _keys(self, start: GrammarMatcher) -> list[tuple[list[int], GrammarMatcher]]:
        """The keys allowed from ``start`` (just after a key's opening ``"``): each as the
        allowed tokens up to the one that holds its closing ``"`` (a trie of the texts the
        masks allow, depth first in token order) and the matcher after them; [] when they are
        not a short list (free text, too many or too long, an escape) or what ends is not a
        key (no ``:`` follows)."""
        token_bytes = self.owner.token_bytes
        keys: list[tuple[list[int], GrammarMatcher]] = []
        stack: list[tuple[GrammarMatcher, list[int], bytes]] = [(start, [], b"")]
        seen: set[bytes] = set()  # texts reached
        named: set[bytes] = set()  # keys listed
        while stack:
            node, tokens, text = stack.pop()
            self.steps -= 1
            allowed = self._allowed(node, KEY_BRANCHES + 1)
            if self.steps < 0 or len(allowed) > KEY_BRANCHES or len(text) >= KEY_BYTES:
                return []
            for token in reversed(_longest(allowed, token_bytes)):  # popped in token order
                raw = token_bytes[token]
                if b"\\" in raw:
                    return []
                if text + raw in seen:
                    continue
                seen.add(text + raw)
                child = node.fork()
                if not child.accept(token):
                    continue
                end = raw.find(b'"')
                if end < 0:
                    stack.append((child, [*tokens, token], text + raw))
                    continue
                rest = raw[end + 1 :].strip()
                if rest and rest[:1] != b":":
                    return []  # a string value, not a key
                key = text + raw[:end]
                if key in named or rest[1:]:
                    continue  # listed already, or the token opens the value too (``":"``)
                if not rest and not self._allows(child, self.owner.colon):
                    return []
                named.add(key)
                keys.append(([*tokens, token], child))
                if len(keys) > KEYS:
                    return []
        return keys

    def _rank(
        self, keys: list[tuple[list[int], GrammarMatcher]]
    ) -> list[tuple[list[int], GrammarMatcher]]:
        """``keys`` best first: a key after which a minimal value lets ``}`` close the object,
        then by how many of the other keys may follow it (after a minimal value and ``,"``):
        fewer first, so in a declared-order object the next required key (the others are the
        optional ones before it). A key no minimal value fits (a pattern, an enum, a required
        object) counts the others it may not follow instead."""
        if len(keys) < 2:
            return keys
        seen = [self._after_value(after) for _, after in keys]
        later = [[False] * len(keys) for _ in keys]  # later[j][k]: key k may follow key j
        for j, state in enumerate(seen):
            if state is None or state[1] is None:
                continue
            for k, (tokens, _) in enumerate(keys):
                self.steps -= 1
                later[j][k] = k != j and state[1].accepted_prefix(tokens) == len(tokens)
        measured = [j for j, state in enumerate(seen) if state is not None and state[1] is not None]

        def score(k: int) -> tuple[float, int]:
            state = seen[k]
            if state is not None and state[1] is None:
                return -1.0, k  # ``}`` may follow: the object closes after it
            if state is not None:
                return float(sum(later[k])), k
            return float(sum(not later[j][k] for j in measured if j != k)), k

        return [keys[k] for k in sorted(range(len(keys)), key=score)]

    def _after_value(self, after: GrammarMatcher) -> tuple[int, GrammarMatcher | None] | None:
        """After a key (``after``: past its closing ``"``), ``:`` and the first minimal value
        that ``}`` or ``,"`` may follow: ``(0, None)`` for ``}``, else ``(1, the state after
        ``,"``)``. None: no minimal value fits."""
        owner = self.owner
        probe = after.fork()
        probe.accept(owner.colon)  # type: ignore[arg-type]  # refused: the key's token held it
        row = owner.row()
        probe.fill_bitmask(row, 0)
        words = row[0].numpy()
        for value in [v for v in owner.values if _bit(words, v[0])]:
            self.steps -= 1
            if probe.accepted_prefix([*value, owner.brace]) == len(value) + 1:  # type: ignore[list-item]
                return 0, None
            follow = [*value, owner.comma, self.quote]
            state = probe.fork()
            if state.accept_tokens(follow) == len(follow):  # type: ignore[arg-type]
                return 1, state
        return None

    def _shortened(
        self, probe: GrammarMatcher, tokens: list[int], after: GrammarMatcher
    ) -> tuple[list[int], GrammarMatcher]:
        """A key's ``"`` and its trie ``tokens`` from ``probe`` (``after``: the state after
        them) as the tokenizer writes the key, where the grammar takes that (fewer tokens)."""
        text = b"".join(self.owner.token_bytes[t] for t in tokens)
        try:
            encoded = self.owner.encode('"' + text.decode())
        except UnicodeDecodeError:
            encoded = []
        if not self.paths.stops.isdisjoint(encoded):  # text that spells a special token
            encoded = []
        child = probe.fork()
        self.steps -= 1
        if encoded and len(encoded) <= len(tokens) and child.accept_tokens(encoded) == len(encoded):
            return encoded, child
        return [self.quote, *tokens], after

    def _alternatives(self, probe: GrammarMatcher, chosen: int) -> list[int]:
        """Departures from ``chosen`` at ``probe``'s state: the other candidates allowed, the
        lowest allowed whitespace token, the lowest other allowed ones; at most
        :data:`ALTERNATIVES`, no stop token."""
        paths = self.paths
        row = self.owner.row()
        probe.fill_bitmask(row, 0)
        words = row[0].numpy()
        lowest = [t for t in _lowest_allowed(words, 64) if t not in paths.stops and t != chosen]
        found = [t for t in paths.candidates if t != chosen and _bit(words, t)]
        found += [t for t in lowest if t in paths.blank][:1]
        found += [t for t in lowest if t not in paths.blank]
        return list(dict.fromkeys(found))[:ALTERNATIVES]

    def _allowed(self, node: GrammarMatcher, count: int) -> list[int]:
        """The ``count`` lowest token ids ``node`` allows (no stop token), ascending."""
        row = self.owner.row()
        node.fill_bitmask(row, 0)
        stops = self.paths.stops
        return [t for t in _lowest_allowed(row[0].numpy(), count) if t not in stops]

    def _allows(self, node: GrammarMatcher, token: int | None) -> bool:
        if token is None:
            return False
        row = self.owner.row()
        node.fill_bitmask(row, 0)
        return _bit(row[0].numpy(), token)


def _longest(tokens: list[int], token_bytes: list[bytes]) -> list[int]:
    """``tokens`` less those whose bytes begin another one's without a ``"`` (a trie of keys
    goes on from the longest: fewer nodes; a key that ends inside a longer one's token is then
    not listed, only ranked no more)."""
    texts = sorted(token_bytes[t] for t in tokens)
    inner = {
        a for a, b in itertools.pairwise(texts) if b != a and b.startswith(a) and b'"' not in a
    }
    return [t for t in tokens if token_bytes[t] not in inner]


def _bit(words: np.ndarray, token: int) -> bool:
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def _run(path: list[int]) -> int:
    """How many times the last token of ``path`` repeats at its end."""
    count = 0
    for token in reversed(path):  # an empty path: 0
        if token != path[-1]:  # path[-1] exists: the loop runs
            break
        count += 1
    return count
