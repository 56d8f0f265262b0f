"""A :class:`automaton.Dfa` back to a regular expression, by state elimination.

The expression is a small tree (:data:`Regex`): a set of symbols, concatenation, alternation,
``?`` and ``*``, simplified as it is built (symbol sets merge, an alternation holding the empty
string becomes ``?``, ``x x*`` prints as ``x+``). States are eliminated fewest paths first,
which keeps chains (``[0-9a-f]{8}-...``) linear. :func:`to_regex` gives the tree and
:func:`spell` the text, each symbol set spelled by the caller (one ``[...]`` class).
"""

from __future__ import annotations

from collections.abc import Callable

from espalier.constrained.schema.automaton import Dfa, reachable

# ("sym", frozenset[int]) | ("eps",) | ("cat", tuple) | ("alt", tuple) | ("opt", x) | ("star", x)
Regex = tuple
EPS: Regex = ("eps",)


def to_regex(dfa: Dfa) -> Regex | None:
    """The language of ``dfa`` as a tree; None when it is empty."""
    live = _live(dfa)
    if 0 not in live:
        return None
    start, end = -1, -2
    edges: dict[tuple[int, int], Regex] = {(start, 0): EPS}
    for state in live:
        by_target: dict[int, set[int]] = {}
        for symbol, target in enumerate(dfa.delta[state]):
            if target in live:
                by_target.setdefault(target, set()).add(symbol)
        for target, symbols in by_target.items():
            edges[(state, target)] = ("sym", frozenset(symbols))
        if state in dfa.finals:
            edges[(state, end)] = EPS
    remaining = set(live)
    while remaining:
        state = min(remaining, key=lambda s: _paths(edges, s))
        remaining.discard(state)
        loop = edges.pop((state, state), None)
        ins = [(p, r) for (p, q), r in edges.items() if q == state]
        outs = [(q, r) for (p, q), r in edges.items() if p == state]
        for p, _ in ins:
            del edges[(p, state)]
        for q, _ in outs:
            del edges[(state, q)]
        middle = star(loop) if loop is not None else EPS
        for p, into in ins:
            for q, out in outs:
                path = cat(cat(into, middle), out)
                edges[(p, q)] = alt(edges[(p, q)], path) if (p, q) in edges else path
    return edges.get((start, end))


def _live(dfa: Dfa) -> set[int]:
    """States reachable from the start that reach a final state."""
    reach = reachable(dfa)
    live = set(dfa.finals) & reach
    changed = True
    while changed:
        changed = False
        for s in reach - live:
            if any(t in live for t in dfa.delta[s]):
                live.add(s)
                changed = True
    return live


def _paths(edges: dict[tuple[int, int], Regex], state: int) -> int:
    ins = sum(1 for p, q in edges if q == state and p != state)
    outs = sum(1 for p, q in edges if p == state and q != state)
    return ins * outs


def cat(a: Regex, b: Regex) -> Regex:
    if a == EPS:
        return b
    if b == EPS:
        return a
    items = (*(a[1] if a[0] == "cat" else (a,)), *(b[1] if b[0] == "cat" else (b,)))
    return ("cat", items)


def alt(a: Regex, b: Regex) -> Regex:
    optional = False
    items: list[Regex] = []
    symbols: set[int] = set()
    for part in (a, b):
        if part[0] == "opt":
            optional, part = True, part[1]
        for item in part[1] if part[0] == "alt" else (part,):
            if item == EPS:
                optional = True
            elif item[0] == "sym":
                symbols |= item[1]
            elif item not in items:
                items.append(item)
    if symbols:
        items.insert(0, ("sym", frozenset(symbols)))
    if not items:
        return EPS
    body = items[0] if len(items) == 1 else ("alt", tuple(items))
    if not optional or body[0] == "star":
        return body
    return ("opt", body)


def star(a: Regex) -> Regex:
    if a == EPS or a[0] == "star":
        return a
    return ("star", a[1] if a[0] == "opt" else a)


def spell(regex: Regex, spell_symbols: Callable[[frozenset[int]], str]) -> str:
    """The text of ``regex``; ``spell_symbols`` spells one symbol set as one atom."""
    kind = regex[0]
    if kind == "eps":
        return ""
    if kind == "sym":
        return spell_symbols(regex[1])
    if kind == "alt":
        return "|".join(spell(r, spell_symbols) for r in regex[1])
    if kind in ("opt", "star"):
        return _atom(regex[1], spell_symbols) + ("?" if kind == "opt" else "*")
    items = regex[1]
    out = []
    i = 0
    while i < len(items):
        item = items[i]
        if i + 1 < len(items) and items[i + 1] == ("star", item):
            out.append(_atom(item, spell_symbols) + "+")
            i += 2
            continue
        out.append(spell(item, spell_symbols) if item[0] != "alt" else _atom(item, spell_symbols))
        i += 1
    return "".join(out)


def _atom(regex: Regex, spell_symbols: Callable[[frozenset[int]], str]) -> str:
    """``regex`` as one unit a quantifier can follow."""
    if regex[0] == "sym":
        return spell_symbols(regex[1])
    return f"(?:{spell(regex, spell_symbols)})"
