"""Where llguidance's reading of a GBNF grammar loses texts the grammar has: greedy lexemes.

llguidance takes GBNF through ``gbnf_to_lark``, which makes each rule built only of literals,
classes and such rules (not ``root``, never a recursive one) a Lark terminal: one lexeme. Its
lexer is greedy: a lexeme ends only where the next character cannot continue it. So where a
character may both continue a complete lexeme and start what follows it, llguidance keeps only
the first reading. llama.cpp's ``arithmetic.gbnf`` (``num ::= [0-9]+ ws``, ``ws ::= [ \\t\\n]*``,
then ``"\\n"``) can then never end: the ``"\\n"`` is always eaten by ``ws``.

:func:`greedy_loss` finds such a terminal: the characters that may continue one of its complete
texts (from its automaton) against the characters that may follow it where it stands as a
lexeme (FIRST / FOLLOW over the rules that stay rules). It names the first terminal whose two
sets meet, else None. The check can claim a loss where greedy splitting happens to keep every
text (``root ::= item+``, ``item ::= [a-c]{1,3}``): such a grammar goes to xgrammar, which is
exact either way. Where it cannot read the grammar, or a terminal's automaton grows past
:data:`MAX_STATES`, it makes no claim (None). It does not look at two different lexemes allowed
at one place (one a prefix of the other's texts), a rarer loss of the same kind.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from espalier.constrained import gbnf
from espalier.constrained.gbnf import Chars, Node

MAX_STATES = 4096
"""Automaton states (NFA or DFA) one terminal may take before the check gives up on it."""
MAX_UNROLLED = 64
"""A bounded repeat with more copies than this is read as unbounded (more continuations: the
check can then only find more losses, never fewer)."""


class _TooBig(Exception):
    pass


def greedy_loss(source: str) -> str | None:
    """The GBNF rule (name as written) that llguidance's greedy lexer reads short in
    ``source``, or None (none found, or no claim)."""
    try:
        rules = gbnf.parse(source)
    except (gbnf.GbnfReadError, RecursionError):
        return None
    terminals = _terminals(rules)
    if not terminals:
        return None
    nfa = _Nfa(rules)
    facts: dict[str, tuple[Chars, bool, Chars]] = {}  # first, nullable, continuations
    try:
        for name in terminals:
            facts[name] = nfa.facts(name)
    except (_TooBig, RecursionError):
        return None
    follow = _follow(rules, terminals, facts)
    for name in terminals:
        chars = follow.get(name)
        if chars and gbnf.intersect(facts[name][2], chars):
            return name
    return None


def _terminals(rules: dict[str, Node]) -> list[str]:
    """The rules ``gbnf_to_lark`` makes terminals: all parts literals, classes or terminals
    (a fixpoint from none; ``root`` stays a rule)."""
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name != "root" and name not in found and gbnf.refs(body) <= found:
                found.add(name)
                changed = True
    return [name for name in rules if name in found]


class _Nfa:
    """A Thompson automaton of one terminal at a time (terminals it names inlined)."""

    def __init__(self, rules: dict[str, Node]) -> None:
        self.rules = rules
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[Chars, int]]] = []

    def _state(self) -> int:
        if len(self.eps) >= MAX_STATES:
            raise _TooBig
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def facts(self, name: str) -> tuple[Chars, bool, Chars]:
        """(first characters, matches the empty text, continuations of a complete text)."""
        self.eps, self.edges = [], []
        start, accept = self._state(), self._state()
        self._build(gbnf.Ref(name), start, accept)
        first_set = self._closure({start})
        first = gbnf.union(*(c for s in first_set for c, _ in self.edges[s]))
        return first, accept in first_set, self._continuations(first_set, accept)

    def _build(self, node: Node, start: int, end: int) -> None:
        if isinstance(node, gbnf.Text):
            here = start
            for char in node.chars:
                nxt = self._state()
                self.edges[here].append((((ord(char), ord(char)),), nxt))
                here = nxt
            self.eps[here].append(end)
        elif isinstance(node, gbnf.CharSet):
            self.edges[start].append((node.chars, end))
        elif isinstance(node, gbnf.Ref):
            self._build(self.rules[node.name], start, end)
        elif isinstance(node, gbnf.Seq):
            here = start
            for item in node.items:
                nxt = self._state()
                self._build(item, here, nxt)
                here = nxt
            self.eps[here].append(end)
        elif isinstance(node, gbnf.Alt):
            for option in node.options:
                self._build(option, start, end)
        else:
            self._repeat(node, start, end)

    def _repeat(self, node: gbnf.Repeat, start: int, end: int) -> None:
        high = node.high if node.high is not None and node.high <= MAX_UNROLLED else None
        here = start
        for _ in range(min(node.low, MAX_UNROLLED)):
            nxt = self._state()
            self._build(node.node, here, nxt)
            here = nxt
        if high is None:  # a loop: here -> body -> here
            back = self._state()
            self.eps[here].append(back)
            self._build(node.node, back, here)
            self.eps[here].append(end)
            return
        for _ in range(high - min(node.low, high)):
            nxt = self._state()
            self.eps[here].append(end)
            self._build(node.node, here, nxt)
            here = nxt
        self.eps[here].append(end)

    def _closure(self, states: set[int]) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for nxt in self.eps[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def _continuations(self, first: frozenset[int], accept: int) -> Chars:
        """Characters leaving a DFA state that holds ``accept`` (every state of a Thompson
        automaton built from non-empty classes can reach ``accept``)."""
        found: list[Chars] = []
        seen, todo = {first}, [first]
        while todo:
            current = todo.pop()
            out = [(c, s) for state in current for c, s in self.edges[state]]
            if accept in current:
                found += [c for c, _ in out]
            for chars in _pieces([c for c, _ in out]):
                probe = chars[0][0]
                nxt = self._closure({s for c, s in out if _holds(c, probe)})
                if nxt not in seen:
                    if len(seen) >= MAX_STATES:
                        raise _TooBig
                    seen.add(nxt)
                    todo.append(nxt)
        return gbnf.union(*found)


def _holds(chars: Chars, point: int) -> bool:
    return any(low <= point <= high for low, high in chars)


def _pieces(sets: list[Chars]) -> list[Chars]:
    """The coarsest partition of the union of ``sets`` whose parts each lie inside or outside
    every one of them (one-interval parts)."""
    cuts = sorted({p for s in sets for low, high in s for p in (low, high + 1)})
    return [
        ((low, high - 1),)
        for low, high in itertools.pairwise(cuts)
        if any(_holds(s, low) for s in sets)
    ]


def _follow(
    rules: dict[str, Node], terminals: list[str], facts: dict[str, tuple[Chars, bool, Chars]]
) -> dict[str, Chars]:
    """Characters that may follow each symbol where it stands in a rule that stays a rule
    (:data:`END`, the end of the text, as code point 0x110000), terminals read as lexemes."""
    terminal = set(terminals)
    nullable: dict[str, bool] = {n: facts[n][1] for n in terminals}
    first: dict[str, Chars] = {n: facts[n][0] for n in terminals}
    kept = [n for n in rules if n not in terminal]
    for n in kept:
        nullable[n], first[n] = False, ()
    changed = True
    while changed:  # FIRST and nullable of the rules that stay rules
        changed = False
        for n in kept:
            f, e = _first(rules[n], first, nullable)
            if f != first[n] or e != nullable[n]:
                first[n], nullable[n], changed = f, e, True
    end_mark: Chars = ((gbnf.MAX_CODE_POINT + 1, gbnf.MAX_CODE_POINT + 1),)
    follow: dict[str, Chars] = {n: () for n in rules}
    follow["root"] = end_mark
    changed = True
    while changed:
        changed = False

        def add(name: str, chars: Chars) -> None:
            nonlocal changed
            merged = gbnf.union(follow[name], chars)
            if merged != follow[name]:
                follow[name], changed = merged, True

        for n in kept:
            _walk_follow(rules[n], follow[n], first, nullable, add)
    return follow


def _first(node: Node, first: dict[str, Chars], nullable: dict[str, bool]) -> tuple[Chars, bool]:
    """(first characters, matches the empty text) of ``node`` under the rules' current facts."""
    if isinstance(node, gbnf.Text):
        return ((((ord(node.chars[0]),) * 2),) if node.chars else ()), not node.chars
    if isinstance(node, gbnf.CharSet):
        return node.chars, False
    if isinstance(node, gbnf.Ref):
        return first[node.name], nullable[node.name]
    if isinstance(node, gbnf.Seq):
        chars: list[Chars] = []
        for item in node.items:
            f, e = _first(item, first, nullable)
            chars.append(f)
            if not e:
                return gbnf.union(*chars), False
        return gbnf.union(*chars), True
    if isinstance(node, gbnf.Alt):
        parts = [_first(o, first, nullable) for o in node.options]
        return gbnf.union(*(f for f, _ in parts)), any(e for _, e in parts)
    f, e = _first(node.node, first, nullable)
    return f, e or node.low == 0


def _walk_follow(
    node: Node,
    after: Chars,
    first: dict[str, Chars],
    nullable: dict[str, bool],
    add: Callable[[str, Chars], None],
) -> None:
    """Give each rule reference in ``node`` the characters that may follow it, ``after``
    being what may follow ``node``."""
    if isinstance(node, gbnf.Ref):
        add(node.name, after)
    elif isinstance(node, gbnf.Seq):
        rest = after
        for item in reversed(node.items):
            _walk_follow(item, rest, first, nullable, add)
            f, e = _first(item, first, nullable)
            rest = gbnf.union(f, rest) if e else f
    elif isinstance(node, gbnf.Alt):
        for option in node.options:
            _walk_follow(option, after, first, nullable, add)
    elif isinstance(node, gbnf.Repeat):
        again = _first(node.node, first, nullable)[0] if node.high != 1 else ()
        _walk_follow(node.node, gbnf.union(after, again), first, nullable, add)
