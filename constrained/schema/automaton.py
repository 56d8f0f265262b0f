"""Deterministic automata over a small symbol alphabet, every construction capped in states.

A :class:`Dfa` is complete over symbols ``0 .. symbols-1`` (one symbol per block of code points,
see :mod:`regular`); state 0 is the start. :func:`from_tree` builds one from a
:mod:`pattern_parse` tree (Thompson automaton, then subsets; an :class:`Anchor` is an ε move
taken only at the start, ``^``, or after which at most one newline may follow, ``$``),
:func:`product` intersects or unites two, :meth:`Dfa.complement` swaps the final states,
:func:`minimal` merges equivalent states (Moore). Each raises :class:`TooBig` past ``cap``
states instead of running long: a pattern such as ``((ab).{4,8}){6}`` searched anywhere has an
automaton far past any cap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from espalier.constrained.schema.pattern_parse import Alt, Anchor, Chars, Node, Repeat

# the phase of an automaton path after anchors (a subset state is ``nfa_state * 3 + phase``)
FREE, AFTER_END, DONE = 0, 1, 2  # AFTER_END: "$" passed, one "\n" may follow; DONE: nothing


class TooBig(Exception):
    """An automaton grew past its cap."""


@dataclass(frozen=True)
class Dfa:
    """``delta[state][symbol]`` is the next state; ``finals`` the accepting states."""

    delta: tuple[tuple[int, ...], ...]
    finals: frozenset[int]

    def complement(self) -> Dfa:
        return Dfa(self.delta, frozenset(range(len(self.delta))) - self.finals)

    def empty(self) -> bool:
        return not self.finals & reachable(self)

    def universal(self) -> bool:
        return reachable(self) <= self.finals


def from_tree(
    tree: Node,
    symbols_of: Callable[[Chars], frozenset[int]],
    symbols: int,
    cap: int,
    newline: int = -1,
) -> Dfa:
    """The automaton of ``tree``; ``symbols_of`` gives the symbols a class stands for,
    ``newline`` the symbol of ``"\\n"`` alone (the one a ``$`` lets follow)."""
    nfa = _Nfa()
    start, end = nfa.build(tree, symbols_of)
    if len(nfa.edges) > 8 * cap:
        raise TooBig("Thompson automaton")
    first = nfa.closure({start * 3 + FREE}, at_start=True)
    index = {first: 0}
    order = [first]
    delta: list[tuple[int, ...]] = []
    for current in order:
        row = []
        for symbol in range(symbols):
            moved = nfa.closure(
                {
                    t * 3 + (phase if phase == FREE else DONE)
                    for code in current
                    if (phase := code % 3) == FREE or (phase == AFTER_END and symbol == newline)
                    for chars, t in nfa.edges[code // 3]
                    if symbol in chars
                },
                at_start=False,
            )
            if moved not in index:
                if len(order) >= cap:
                    raise TooBig("subset construction")
                index[moved] = len(order)
                order.append(moved)
            row.append(index[moved])
        delta.append(tuple(row))
    finals = {end * 3 + phase for phase in (FREE, AFTER_END, DONE)}
    return Dfa(tuple(delta), frozenset(i for i, s in enumerate(order) if finals & s))


def product(a: Dfa, b: Dfa, both: bool, cap: int) -> Dfa:
    """``a ∩ b`` (``both``) or ``a ∪ b`` over the reachable pairs of states."""
    index = {(0, 0): 0}
    order = [(0, 0)]
    delta: list[tuple[int, ...]] = []
    for x, y in order:
        row = []
        for nx, ny in zip(a.delta[x], b.delta[y], strict=True):
            if (nx, ny) not in index:
                if len(order) >= cap:
                    raise TooBig("product")
                index[(nx, ny)] = len(order)
                order.append((nx, ny))
            row.append(index[(nx, ny)])
        delta.append(tuple(row))
    accept = (lambda p, q: p and q) if both else (lambda p, q: p or q)
    finals = frozenset(i for i, (x, y) in enumerate(order) if accept(x in a.finals, y in b.finals))
    return Dfa(tuple(delta), finals)


def minimal(dfa: Dfa) -> Dfa:
    """The minimal complete automaton of the same language (reachable states, Moore)."""
    reach = sorted(reachable(dfa))
    block = {s: int(s in dfa.finals) for s in reach}
    while True:
        keys = {s: (block[s], tuple(block[t] for t in dfa.delta[s])) for s in reach}
        numbering: dict[tuple[int, tuple[int, ...]], int] = {}
        for s in reach:  # state 0 first: it stays the start
            numbering.setdefault(keys[s], len(numbering))
        refined = {s: numbering[keys[s]] for s in reach}
        if len(numbering) == len(set(block.values())):
            break
        block = refined
    block = refined
    rows: dict[int, tuple[int, ...]] = {}
    for s in reach:
        rows.setdefault(block[s], tuple(block[t] for t in dfa.delta[s]))
    finals = frozenset(block[s] for s in reach if s in dfa.finals)
    return Dfa(tuple(rows[i] for i in range(len(rows))), finals)


def reachable(dfa: Dfa) -> set[int]:
    """The states some string leads to from the start."""
    seen, stack = {0}, [0]
    while stack:
        for t in dfa.delta[stack.pop()]:
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return seen


class _Nfa:
    """A Thompson automaton: ``edges[s]`` = (symbols, target) pairs, ``empty[s]`` = ε moves,
    ``asserted[s]`` = (anchor kind, target) ε moves taken only where the anchor holds."""

    def __init__(self) -> None:
        self.edges: list[list[tuple[frozenset[int], int]]] = []
        self.empty: list[list[int]] = []
        self.asserted: list[list[tuple[str, int]]] = []

    def state(self) -> int:
        self.edges.append([])
        self.empty.append([])
        self.asserted.append([])
        return len(self.edges) - 1

    def closure(self, codes: set[int], at_start: bool) -> frozenset[int]:
        """The ε closure of ``codes`` (``state * 3 + phase``); ``at_start``: nothing read yet."""
        stack, seen = list(codes), set(codes)
        while stack:
            code = stack.pop()
            state, phase = divmod(code, 3)
            targets = [t * 3 + phase for t in self.empty[state]]
            for kind, t in self.asserted[state]:
                if kind != "^":
                    targets.append(t * 3 + (DONE if kind == "$z" else max(phase, AFTER_END)))
                elif at_start:
                    targets.append(t * 3 + phase)
            for target in targets:
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        return frozenset(seen)

    def build(self, node: Node, symbols_of: Callable[[Chars], frozenset[int]]) -> tuple[int, int]:
        start, end = self.state(), self.state()
        if isinstance(node, Chars):
            self.edges[start].append((symbols_of(node), end))
        elif isinstance(node, Anchor):
            self.asserted[start].append((node.kind, end))
        elif isinstance(node, Alt):
            for option in node.options:
                at = start
                for item in option:
                    s, e = self.build(item, symbols_of)
                    self.empty[at].append(s)
                    at = e
                self.empty[at].append(end)
        else:
            assert isinstance(node, Repeat)
            at = start
            for _ in range(node.low):
                s, e = self.build(node.item, symbols_of)
                self.empty[at].append(s)
                at = e
            if node.high is None:
                s, e = self.build(node.item, symbols_of)
                self.empty[at] += [s, end]
                self.empty[e] += [s, end]
            else:
                for _ in range(node.high - node.low):
                    s, e = self.build(node.item, symbols_of)
                    self.empty[at] += [s, end]
                    at = e
            self.empty[at].append(end)
        return start, end
