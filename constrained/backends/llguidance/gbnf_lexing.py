"""Where llguidance's reading of a GBNF grammar loses texts the grammar has: greedy lexemes.

llguidance takes GBNF through ``gbnf_to_lark``, which makes each rule built only of literals,
classes and such rules (not ``root``, never a recursive one) a Lark terminal, and each literal
and class elsewhere a lexeme of its own. Its lexer is greedy: among the lexemes allowed at a
place, it goes on while the next character continues one of them, and a lexeme ends only where
none goes on. So where a lexeme is complete and the next character both continues a lexeme
allowed there (itself or another) and starts what may follow it, llguidance keeps only the
longer reading. Examples (each loses the text after it): llama.cpp's ``arithmetic.gbnf``
(``num ::= [0-9]+ ws``, ``ws ::= [ \\t\\n]*``, then ``"\\n"``: ``1=2\\n``, no text can end);
``root ::= [a-z]+ "xy"`` (``axyxy``); ``root ::= ("a" | "aa") "a"`` (``aa``).

:func:`greedy_loss` finds such a place. The lexemes' places come from FIRST / FOLLOW over lexeme
occurrences (the rules that stay rules walked, terminals read as lexemes): the lexemes that may
start together (``FIRST(root)``, and what may follow each occurrence or rule reference as its
own rule says: a rule's end adds nothing, so two lexemes that meet only through the rules around
it, such as ``json_arr.gbnf``'s ``","`` of objects and ``",\\n"`` of its array, are not
compared), and for each occurrence the characters that may start what follows it anywhere. For
two lexemes allowed together, their automata (Thompson, subset construction over code point
intervals) are run side by side to find the characters that may continue a non-empty complete
text of the first as a prefix of the second. Where those meet what may follow the first, texts
may be lost. The check is conservative: it can name a place where greedy splitting happens to
keep every text (``item+`` with ``item ::= [a-c]{1,3}``), and a grammar too large for it
(:data:`MAX_STATES`) counts as lossy; such grammars go to xgrammar, which reads GBNF exactly.
Where it cannot read the grammar at all (a text only llguidance's converter takes) it makes no
claim.

Two more readings differ, and are refused or respelled by the adapter: ``.`` (``/./``, which
leaves out ``\\n`` in Rust: respelled ``/(?s:.)/``) and classes holding ``&&``, ``--`` or ``~~``
(set operations in Rust: :func:`set_operation`).
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable

from llguidance.gbnf_to_lark import gbnf_to_lark

from espalier.constrained import gbnf
from espalier.constrained.gbnf import Chars, Node

MAX_STATES = 20_000
"""Automaton states (a lexeme's NFA, a pair's product) and occurrences one check may take; past
it the grammar counts as lossy."""
MAX_WORK = 1_000_000
"""Automaton states made and edges visited by one check (well under 1 s on this CPU); past it
the grammar counts as lossy."""
MAX_UNROLLED = 64
"""A bounded repeat with more copies than this is read as unbounded (more continuations: the
check can then only find more losses, never fewer)."""
TOO_LARGE = "a grammar too large for the check that llguidance's reading keeps every text"
END = -1  # an occurrence id for the end of the text
_SET_OPERATION = re.compile(r"&&|--|~~")


class _TooBig(Exception):
    pass


class _Budget:
    """The work one check may do (automaton edges visited, states made): :data:`MAX_WORK`."""

    def __init__(self) -> None:
        self.left = MAX_WORK

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise _TooBig


def greedy_loss(source: str) -> str | None:
    """Where llguidance's greedy lexer may read ``source`` short (``rule 'x'``, ``literal
    "ab"`` or ``class [...]``, or :data:`TOO_LARGE`), else None (none found, or no claim)."""
    try:
        rules = gbnf.parse(source)
    except (gbnf.GbnfReadError, RecursionError):
        return None
    try:
        return _Check(rules).loss()
    except (_TooBig, RecursionError):
        return TOO_LARGE


def set_operation(source: str) -> str | None:
    """The first class of ``source`` holding ``&&``, ``--`` or ``~~`` (copied into a Rust
    regex by ``gbnf_to_lark``, they are set operations there, plain characters in GBNF)."""
    for match in gbnf.TOKEN.finditer(source):
        if match.lastgroup == "cls" and _SET_OPERATION.search(match.group()):
            return match.group()
    return None


def _terminals(rules: dict[str, Node]) -> set[str]:
    """The rules ``gbnf_to_lark`` makes terminals: all parts literals, classes or terminals
    (the least fixpoint; ``root`` stays a rule, so does every rule on a cycle)."""
    state: dict[str, bool] = {}

    def terminal(name: str) -> bool:
        if name not in state:
            state[name] = False  # on the path: a cycle is not terminal
            state[name] = name != "root" and all(terminal(r) for r in gbnf.refs(rules[name]))
        return state[name]

    return {name for name in rules if terminal(name)}


class _Nfa:
    """A Thompson automaton of one lexeme (terminals it names inlined)."""

    def __init__(self, rules: dict[str, Node], node: Node, budget: _Budget) -> None:
        self.rules = rules
        self.budget = budget
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[Chars, int]]] = []
        self._cuts: dict[frozenset[int], list[int]] = {}
        self._steps: dict[tuple[frozenset[int], int], frozenset[int]] = {}
        self.start, self.accept = self._state(), self._state()
        self._build(node, self.start, self.accept)
        self.first = self.closure({self.start})

    def _state(self) -> int:
        if len(self.eps) >= MAX_STATES:
            raise _TooBig
        self.budget.spend(1)
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

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

    def closure(self, states: set[int]) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for nxt in self.eps[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def out(self, states: frozenset[int]) -> list[tuple[Chars, int]]:
        return [edge for state in states for edge in self.edges[state]]

    def cuts(self, states: frozenset[int]) -> list[int]:
        """Sorted points where the characters leaving ``states`` change (cached)."""
        found = self._cuts.get(states)
        if found is None:
            self.budget.spend(len(states))
            found = sorted({p for c, _ in self.out(states) for lo, hi in c for p in (lo, hi + 1)})
            self._cuts[states] = found
        return found

    def step(self, states: frozenset[int], point: int) -> frozenset[int]:
        """The states after reading code point ``point`` from ``states`` (cached)."""
        key = (states, point)
        found = self._steps.get(key)
        if found is None:
            out = self.out(states)
            self.budget.spend(len(out))
            found = self.closure({s for c, s in out if _holds(c, point)})
            self._steps[key] = found
        return found


def _continuations(a: _Nfa, b: _Nfa) -> Chars:
    """Characters ``c`` such that ``w c`` begins a text of ``b`` for a non-empty complete text
    ``w`` of ``a`` (both automata run side by side over ``w``; every Thompson state of
    non-empty classes can reach its accept state)."""
    found: list[Chars] = []
    start = (a.first, b.first, False)  # (a's states, b's states, a character read)
    seen, todo = {start}, [start]
    while todo:
        sa, sb, read = todo.pop()
        if read and a.accept in sa:
            found += [c for c, _ in b.out(sb)]
        b_cuts = b.cuts(sb)
        for low, high in _pieces([c for c, _ in a.out(sa)]):
            # a's piece, split where b's characters change
            inner = b_cuts[bisect.bisect_right(b_cuts, low) : bisect.bisect_right(b_cuts, high)]
            for point in [low, *inner]:
                na, nb = a.step(sa, point), b.step(sb, point)
                pair = (na, nb, True)
                if na and nb and pair not in seen:
                    a.budget.spend(1)
                    seen.add(pair)
                    todo.append(pair)
    return gbnf.union(*found)


def _holds(chars: Chars, point: int) -> bool:
    return any(low <= point <= high for low, high in chars)


def _pieces(sets: list[Chars]) -> list[tuple[int, int]]:
    """The coarsest partition of the union of ``sets`` into intervals each inside or outside
    every one of them."""
    cuts = sorted({p for s in sets for low, high in s for p in (low, high + 1)})
    return [
        (low, high - 1)
        for low, high in itertools.pairwise(cuts)
        if any(_holds(s, low) for s in sets)
    ]


Occurrences = frozenset[int]


class _Check:
    """FIRST / FOLLOW over lexeme occurrences of the rules that stay rules (module docstring)."""

    def __init__(self, rules: dict[str, Node]) -> None:
        self.rules = rules
        self.terminal = _terminals(rules)
        self.kept = [n for n in rules if n not in self.terminal]
        self.lexeme: list[Node] = []  # occurrence id -> its lexeme (a Text, CharSet, Ref)
        self._ids: dict[int, int] = {}  # id() of an atom node -> occurrence id
        for name in self.kept:
            self._number(rules[name])
        self.budget = _Budget()
        self._nfas: dict[Node, _Nfa] = {}
        self._ext: dict[tuple[Node, Occurrences], Chars] = {}
        self._unions: dict[Occurrences, _Nfa] = {}
        self._after: dict[Occurrences, Chars] = {}  # what may follow -> its first characters

    def _number(self, node: Node) -> None:
        if isinstance(node, gbnf.Text | gbnf.CharSet) or (
            isinstance(node, gbnf.Ref) and node.name in self.terminal
        ):
            if isinstance(node, gbnf.Text) and not node.chars:
                return
            if len(self.lexeme) >= MAX_STATES:
                raise _TooBig
            self._ids[id(node)] = len(self.lexeme)
            self.lexeme.append(node)
        elif isinstance(node, gbnf.Seq | gbnf.Alt):
            for child in node.items if isinstance(node, gbnf.Seq) else node.options:
                self._number(child)
        elif isinstance(node, gbnf.Repeat):
            self._number(node.node)

    def nfa(self, node: Node) -> _Nfa:
        if node not in self._nfas:
            self._nfas[node] = _Nfa(self.rules, node, self.budget)
        return self._nfas[node]

    def loss(self) -> str | None:
        first: dict[str, Occurrences] = {n: frozenset() for n in self.kept}
        nullable: dict[str, bool] = {n: False for n in self.kept}
        changed = True
        while changed:  # FIRST and nullable of the rules that stay rules
            changed = False
            for n in self.kept:
                f, e = self._first(self.rules[n], first, nullable)
                if f != first[n] or e != nullable[n]:
                    first[n], nullable[n], changed = f, e, True
        follow: dict[object, set[int]] = {n: set() for n in self.kept}
        follow["root"] = {END}

        def add(key: object, after: Occurrences) -> None:
            nonlocal changed
            known = follow.setdefault(key, set())
            if not after <= known:
                known |= after
                changed = True

        changed = True
        while changed:
            changed = False
            for n in self.kept:
                self._walk(self.rules[n], frozenset(follow[n]), first, nullable, add)
        places = {first["root"]}  # each place's lexemes as its rule alone says (module docstring)

        def note(key: object, after: Occurrences) -> None:
            places.add(after)

        for n in self.kept:
            self._walk(self.rules[n], frozenset(), first, nullable, note)
        starts: dict[int, Chars] = {}
        for place in places:
            occurrences = place - {END}
            if not occurrences:
                continue
            lexemes = tuple(dict.fromkeys(self.lexeme[o] for o in sorted(occurrences)))
            # one automaton for all the lexemes of the place (a frozenset keys it: its hash is
            # kept, a 2,000-option Alt's is not)
            union = self._unions.get(occurrences)
            if union is None:
                node = lexemes[0] if len(lexemes) == 1 else gbnf.Alt(lexemes)
                union = self._unions[occurrences] = _Nfa(self.rules, node, self.budget)
            for a in sorted(occurrences):
                if a not in starts:
                    after = frozenset(follow.get(a, set()) - {END})
                    if after not in self._after:
                        self.budget.spend(len(after))
                        firsts = {self.lexeme[o] for o in after}
                        self._after[after] = gbnf.union(*(self._starts(x) for x in firsts))
                    starts[a] = self._after[after]
                if not starts[a]:
                    continue
                key = (self.lexeme[a], occurrences)
                if key not in self._ext:
                    self._ext[key] = _continuations(self.nfa(self.lexeme[a]), union)
                if gbnf.intersect(self._ext[key], starts[a]):
                    return self._label(self.lexeme[a])
        return None

    def _starts(self, lexeme: Node) -> Chars:
        nfa = self.nfa(lexeme)
        return gbnf.union(*(c for c, _ in nfa.out(nfa.first)))

    def _nullable_lexeme(self, lexeme: Node) -> bool:
        nfa = self.nfa(lexeme)
        return nfa.accept in nfa.first

    @staticmethod
    def _label(lexeme: Node) -> str:
        if isinstance(lexeme, gbnf.Ref):
            return f"rule '{lexeme.name}'"
        if isinstance(lexeme, gbnf.Text):
            return f"literal {lexeme.chars!r}"
        return "a character class"

    def _first(
        self, node: Node, first: dict[str, Occurrences], nullable: dict[str, bool]
    ) -> tuple[Occurrences, bool]:
        """(occurrences that may come first, matches the empty text) of ``node``."""
        if id(node) in self._ids:
            return frozenset({self._ids[id(node)]}), self._nullable_lexeme(node)
        if isinstance(node, gbnf.Text):  # the empty literal
            return frozenset(), True
        if isinstance(node, gbnf.Ref):
            return first[node.name], nullable[node.name]
        if isinstance(node, gbnf.Seq):
            found: set[int] = set()
            for item in node.items:
                f, e = self._first(item, first, nullable)
                found |= f
                if not e:
                    return frozenset(found), False
            return frozenset(found), True
        if isinstance(node, gbnf.Alt):
            parts = [self._first(o, first, nullable) for o in node.options]
            return frozenset().union(*(f for f, _ in parts)), any(e for _, e in parts)
        assert isinstance(node, gbnf.Repeat)
        f, e = self._first(node.node, first, nullable)
        return f, e or node.low == 0

    def _walk(
        self,
        node: Node,
        after: Occurrences,
        first: dict[str, Occurrences],
        nullable: dict[str, bool],
        add: Callable[[object, Occurrences], None],
    ) -> None:
        """Give each occurrence and rule reference in ``node`` what may follow it, ``after``
        being what may follow ``node``."""
        if id(node) in self._ids:
            add(self._ids[id(node)], after)
        elif isinstance(node, gbnf.Ref):
            add(node.name, after)
        elif isinstance(node, gbnf.Seq):
            rest = after
            for item in reversed(node.items):
                self._walk(item, rest, first, nullable, add)
                f, e = self._first(item, first, nullable)
                rest = f | rest if e else f
        elif isinstance(node, gbnf.Alt):
            for option in node.options:
                self._walk(option, after, first, nullable, add)
        elif isinstance(node, gbnf.Repeat):
            again = self._first(node.node, first, nullable)[0] if node.high != 1 else frozenset()
            self._walk(node.node, after | again, first, nullable, add)


def refusal(source: str) -> str | None:
    """Why llguidance should not take the GBNF ``source`` (its reading would differ from
    llama.cpp's), or None."""
    found = set_operation(source)
    if found is not None:
        return f"its class {found} holds a pair llguidance's regexes read as a set operation"
    where = greedy_loss(source)
    if where == TOO_LARGE:
        return f"it is {TOO_LARGE}"
    if where is not None:
        return (
            f"llguidance's greedy lexer may lose texts of it at its {where}: a character may "
            "both continue a lexeme there and start what follows it"
        )
    return None


_LARK_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"|/(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*')


def lark_of(source: str) -> str:
    """The GBNF ``source`` as llguidance's Lark (``gbnf_to_lark``, which raises assorted errors
    on bad input), its ``\\u`` / ``\\U`` escapes written first as the characters they name
    (:func:`exact_escapes`), each ``.`` (written ``/./``, which leaves out ``\\n``) respelled
    ``/(?s:.)/``: any character, as in llama.cpp."""
    lark = gbnf_to_lark(exact_escapes(source))
    return _LARK_PIECE.sub(lambda m: "/(?s:.)/" if m.group() == "/./" else m.group(), lark)


_WIDE_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|.)", re.DOTALL)


def exact_escapes(source: str) -> str:
    """``source`` with each ``\\uHHHH`` / ``\\UHHHHHHHH`` escape of its literals and classes
    written as its character (``\\xHH`` below U+0080, where the character may be special).
    llama.cpp reads exactly 4 or 8 hex digits; ``gbnf_to_lark`` drops leading zeros, so
    ``"\\u004100"`` (``A00``) became ``"\\u4100"`` (one CJK character, a false accept)."""

    def piece(token: re.Match[str]) -> str:
        if token.lastgroup not in ("lit", "cls"):
            return token.group()
        return _WIDE_ESCAPE.sub(_character, token.group())

    return gbnf.TOKEN.sub(piece, source)


def _character(escape: re.Match[str]) -> str:
    digits = escape.group(1) or escape.group(2)
    if digits is None:
        return escape.group()  # another escape: as it was
    point = int(digits, 16)
    if point < 0x80:
        return f"\\x{point:02x}"
    if 0xD800 <= point <= 0xDFFF or point > gbnf.MAX_CODE_POINT:
        return escape.group()  # no character: left for llguidance to refuse
    return chr(point)
