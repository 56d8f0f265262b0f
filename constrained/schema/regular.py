"""Complement and intersection of ``pattern`` languages, printed back as one anchored pattern.

The languages come from :mod:`pattern_parse` (the post-validator's ``regex.search`` meaning).
The code points are first split into the blocks no pattern involved tells apart (``\\w``'s ~700
ranges become a few blocks), one symbol per block; :mod:`automaton` builds capped deterministic
automata over those symbols (complement, intersection, minimisation) and :mod:`dfa_regex` turns
the result back into an expression, which :func:`_class` spells in the subset the three
backends read alike: ASCII letters and digits as themselves, every other character inside
``[...]``; classes of explicit code point ranges (no ``\\d`` / ``\\w`` shorthands, whose
meaning differs between engines; ASCII punctuation and non-printable BMP characters as
``\\uXXXX``), ``(?:...)``, ``|``, ``*``, ``+``, ``?``, wrapped
in ``^(?:...)$``. llguidance, xgrammar and outlines-core read such a ``^...$`` as a full match
of the body (no trailing newline); the post-validator's ``$`` also takes one final newline,
which :func:`_without_newline_twins` accounts for, so both readings stay within the language.

Surrogate code points (U+D800-U+DFFF) are left out of every printed result: a backend cannot
write one (UTF-8), so this narrows only strings no model can produce. Everything is bounded
(:data:`MAX_POSITIONS` repeated atoms in the inputs, :data:`MAX_BUILT` states of any automaton,
:data:`MAX_STATES` of the printed one, :data:`MAX_PRINTED` characters); past a bound the answer
is None and the caller leaves the keyword as it was (strict mode refuses it, naming it).
"""

from __future__ import annotations

import functools

from espalier.constrained.schema.automaton import Dfa, TooBig, from_tree, minimal, product
from espalier.constrained.schema.dfa_regex import spell, to_regex
from espalier.constrained.schema.pattern_parse import (
    ANY,
    NEWLINE,
    Alt,
    Anchor,
    Chars,
    Node,
    Repeat,
    Unsupported,
    search_constraints,
)

MAX_POSITIONS = 160  # atoms of the inputs with repetitions unrolled: bounds the automata built
MAX_BUILT = 4_000  # states of any automaton built on the way
MAX_STATES = 64  # of the minimal automaton printed (the expression grows with them)
MAX_PRINTED = 20_000
SURROGATES = Chars(((0xD800, 0xDFFF),))
CONTROLS = Chars(((0x00, 0x1F),))


BOTH_READINGS = (False, True)
"""``\\d`` / ``\\w`` / ``\\s`` as the post-validator (``regex``: Unicode) and as JSON Schema
(ECMA-262: ASCII) read them. A pattern printed for the backends keeps what both readings
agree on, so an output is valid under either: ``^(?=b)\\w+$`` wrote ``"botonesivesseällt"``,
which ECMA-262 validators reject."""


def complement_pattern(pattern: str, min_length: int = 0) -> str | bool | None:
    """A pattern matching exactly the strings ``pattern`` does not (``False``: no string;
    ``True``: every string); None when not expressible within the bounds. ``min_length``: only
    strings of at least that many code points are in question (a ``minLength`` next to the
    ``not``): the answer is exact on those, which drops ``""`` (the complement of ``^\\s+$``
    holds ``""`` but not ``"\\n"``, which no ``^R$`` can say under the post-validator's ``$``)."""
    return _combine((pattern,), negate=True, min_length=min_length)


def intersect_patterns(patterns: tuple[str, ...], controls: bool = True) -> str | bool | None:
    """One pattern matching exactly the strings every one of ``patterns`` matches (``False``:
    no string does; ``True``: every string); None when not expressible within the bounds.
    ``controls`` False: less the strings holding a control character (U+0000-U+001F)."""
    return _combine(patterns, negate=False, min_length=0, controls=controls)


def patterns_meet(patterns: tuple[str, ...], final_newline: bool = True) -> bool | None:
    """Whether some string matches every one of ``patterns`` under one reading of their
    classes or the other (``BOTH_READINGS``); None when they are not read."""
    meets = False
    for ascii_classes in BOTH_READINGS:
        found = _language(patterns, False, final_newline, 0, (ascii_classes,))
        if found is None:
            return None
        meets = meets or not found[0].empty()
    return meets


@functools.lru_cache(maxsize=512)
def pattern_word_count(pattern: str, cap: int) -> int | None:
    """How many strings ``pattern`` matches as the backends read it (``^...$`` a full match,
    no final newline), when fewer than ``cap``; None when ``cap`` or more, infinitely many, or
    the pattern is not read. Why: an object whose keys can only come from finite patterns
    holds at most that many (``empty.py``'s ``minProperties`` check)."""
    found = _language((pattern,), False, False, 0)
    if found is None:
        return None
    dfa, alphabet = found
    weight = [sum(b - a + 1 for a, b in block) for block in alphabet.blocks]
    live = _co_reachable(dfa)
    counts: dict[int, int] = {}
    on_path: set[int] = set()

    def count(state: int) -> int | None:  # None: a cycle (infinitely many) or past the cap
        if state in counts:
            return counts[state]
        if state in on_path:
            return None
        on_path.add(state)
        total = 1 if state in dfa.finals else 0
        for symbol, target in enumerate(dfa.delta[state]):
            if target not in live:
                continue
            sub = count(target)
            if sub is None:
                return None
            total += weight[symbol] * sub
            if total >= cap:
                return None
        on_path.discard(state)
        counts[state] = total
        return total

    return count(0) if 0 in live else 0


@functools.lru_cache(maxsize=512)
def pattern_longest(pattern: str, cap: int) -> int | None:
    """The length of the longest string ``pattern`` matches as the backends read it (a full
    match of ``^...$``, no final newline), when below ``cap``; None when ``cap`` or more,
    unbounded, or the pattern is not read. Why: a unique array's string item at that length
    can only end (``unique_places``)."""
    found = _language((pattern,), False, False, 0)
    if found is None:
        return None
    dfa, _ = found
    live = _co_reachable(dfa)
    longest: dict[int, int] = {}
    on_path: set[int] = set()

    def visit(state: int) -> int | None:  # None: a cycle or past the cap
        if state in longest:
            return longest[state]
        if state in on_path:
            return None
        on_path.add(state)
        most = 0
        for target in dfa.delta[state]:
            if target not in live:
                continue
            sub = visit(target)
            if sub is None or sub + 1 >= cap:
                return None
            most = max(most, sub + 1)
        on_path.discard(state)
        longest[state] = most
        return most

    return visit(0) if 0 in live else None


@functools.lru_cache(maxsize=512)
def pattern_words(
    pattern: str,
    cap: int,
    readings: tuple[bool, ...] = BOTH_READINGS,
    lengths: tuple[int, int | None] = (0, None),
) -> tuple[str, ...] | None:
    """The strings ``pattern`` matches as the backends read it (a full match of ``^...$``, no
    final newline) under every reading of its classes in ``readings`` (default: both, the
    strings JSON Schema's and Python's dialects agree on), of ``lengths`` code points (at least,
    at most; None: no most), in code point order, when fewer than ``cap`` and none holds a
    surrogate code point; None when ``cap`` or more, infinitely many, or the pattern is not
    read. Why: an object whose keys can only come from such patterns lists them as properties
    (``pattern_properties.finite_names``); a unique array's string items from such a list are
    tracked word by word (``unique_places``)."""
    listed = _listed_words(pattern, cap, readings)
    if listed is not None:
        low, high = lengths
        kept = (w for w in listed if low <= len(w) and (high is None or len(w) <= high))
        return tuple(sorted(kept))
    return _automaton_words(pattern, cap, readings, lengths)


def _automaton_words(
    pattern: str, cap: int, readings: tuple[bool, ...], lengths: tuple[int, int | None]
) -> tuple[str, ...] | None:
    """:func:`pattern_words` read off the pattern's minimal automaton (bounded in positions
    and states)."""
    low, high = lengths
    patterns = (pattern,) if high is None else (pattern, f"^[\\s\\S]{{0,{high}}}$")
    found = _language(patterns, False, False, low, readings)
    if found is None:
        return None
    dfa, alphabet = found
    live = _co_reachable(dfa)
    words: list[str] = []
    on_path: set[int] = set()

    def visit(state: int, prefix: str) -> bool:  # False: a cycle, a surrogate or the cap
        if state in on_path:
            return False
        if state in dfa.finals:
            words.append(prefix)
            if len(words) >= cap:
                return False
        on_path.add(state)
        for symbol, target in enumerate(dfa.delta[state]):
            if target not in live:
                continue
            for first, last in alphabet.blocks[symbol]:
                if last - first >= cap or (last >= 0xD800 and first <= 0xDFFF):
                    return False
                for code in range(first, last + 1):
                    if not visit(target, prefix + chr(code)):
                        return False
        on_path.discard(state)
        return True

    if 0 in live and not visit(0, ""):
        return None
    return tuple(sorted(words))


LISTED_PATTERN_CHARS = 16_384
"""The longest pattern :func:`_listed_words` reads (listing is linear in the tree and capped;
the automata keep ``pattern_parse.MAX_PATTERN_CHARS``): about 2,000 words of 7 characters, a
few tenths of a second of admission."""


def _listed_words(pattern: str, cap: int, readings: tuple[bool, ...]) -> set[str] | None:
    """:func:`pattern_words` without an automaton, for a pattern without lookaheads whose
    language is finite and smaller than ``cap`` at every step of its reading: each reading's
    strings listed straight from its tree, the readings' common ones kept. Why: an anchored
    alternation of a few hundred words (an ``enum`` written as a ``pattern``) is past the
    automata's bound on positions, and its words are what unique items are tracked by. None:
    not such a pattern (the automaton decides)."""
    common: set[str] | None = None
    for ascii_classes in readings:
        try:
            read = search_constraints(pattern, False, ascii_classes, LISTED_PATTERN_CHARS)
        except Unsupported:
            return None
        if len(read) != 1 or read[0][1]:
            return None
        words = _tree_words(read[0][0], cap)
        if words is None:
            return None
        common = words if common is None else common & words
    return common


def _tree_words(node: Node, cap: int) -> set[str] | None:
    """The strings of ``node`` when fewer than ``cap`` (and every part's too), none holding a
    surrogate code point; else None."""
    if isinstance(node, Chars):
        if sum(b - a + 1 for a, b in node.ranges) >= cap:
            return None
        if any(a <= 0xDFFF and b >= 0xD800 for a, b in node.ranges):
            return None
        return {chr(c) for a, b in node.ranges for c in range(a, b + 1)}
    if isinstance(node, Alt):
        out: set[str] = set()
        for option in node.options:
            words = {""}
            for part in option:
                longer = _concat(words, _tree_words(part, cap), cap)
                if longer is None:
                    return None
                words = longer
            out |= words
            if len(out) >= cap:
                return None
        return out
    if isinstance(node, Repeat):
        if node.high is None or node.high >= cap:
            return None
        item = _tree_words(node.item, cap)
        if item is None:
            return None
        out, power = set(), {""}
        for count in range(node.high + 1):
            if count >= node.low:
                out |= power
            if count == node.high or not item:
                break
            grown = _concat(power, item, cap)
            if grown is None:
                return None
            if grown == power:  # the item is the empty string alone
                break
            power = grown
        return out if len(out) < cap else None
    return None  # an anchor left in the tree: not read here


def _concat(left: set[str], right: set[str] | None, cap: int) -> set[str] | None:
    """Every string of ``left`` followed by one of ``right``; None when ``right`` is None or
    the product reaches ``cap``."""
    if right is None or len(left) * len(right) >= cap:
        return None
    return {a + b for a in left for b in right}


def _co_reachable(dfa: Dfa) -> set[int]:
    """The states from which some string reaches a final state."""
    into: dict[int, set[int]] = {}
    for state, row in enumerate(dfa.delta):
        for target in row:
            into.setdefault(target, set()).add(state)
    seen, stack = set(dfa.finals), list(dfa.finals)
    while stack:
        for source in into.get(stack.pop(), ()):
            if source not in seen:
                seen.add(source)
                stack.append(source)
    return seen


@functools.lru_cache(maxsize=512)
def _language(
    patterns: tuple[str, ...],
    negate: bool,
    final_newline: bool,
    min_length: int,
    readings: tuple[bool, ...] = (False,),
) -> tuple[Dfa, _Alphabet] | None:
    """The minimal automaton of the intersection (of the complements, ``negate``) with the
    strings of ``min_length`` code points or more, and its alphabet; None when a pattern is not
    read or a bound is passed. ``readings``: the ``search_constraints`` ``ascii_classes`` each
    pattern is read with; with both, a string is kept where every reading keeps it (matches,
    or with ``negate`` fails to match, under both)."""
    try:
        read = [
            search_constraints(p, final_newline, ascii_classes)
            for p in patterns
            for ascii_classes in readings
        ]
    except Unsupported:
        return None
    trees = [tree for constraints in read for tree, _ in constraints]
    if sum(_positions(t) for t in trees) > MAX_POSITIONS * len(readings):
        return None
    alphabet = _Alphabet([*_classes(trees), SURROGATES, CONTROLS, NEWLINE])
    try:
        result = alphabet.dfa(Repeat(ANY, min_length, None))
        for constraints in read:
            dfa = alphabet.dfa(constraints[0][0])
            for tree, negated in constraints[1:]:  # lookaheads: an intersection
                look = alphabet.dfa(tree)
                dfa = product(dfa, look.complement() if negated else look, True, MAX_BUILT)
            result = minimal(product(result, dfa.complement() if negate else dfa, True, MAX_BUILT))
    except TooBig:
        return None
    return result, alphabet


@functools.lru_cache(maxsize=512)
def _combine(
    patterns: tuple[str, ...], negate: bool, min_length: int, controls: bool = True
) -> str | bool | None:
    found = _language(patterns, negate, True, min_length, BOTH_READINGS)
    if found is None:
        return None
    result, alphabet = found
    if result.empty():
        return False
    if result.universal():
        return True
    try:
        printed = _without_newline_twins(result, alphabet)
        if printed is None:
            return None
        writable = alphabet.dfa(Repeat(alphabet.writable_chars(controls), 0, None))
        printed = minimal(product(printed, writable, True, MAX_BUILT))
    except TooBig:
        return None
    if printed.empty() or len(printed.delta) > MAX_STATES:
        return None  # only surrogate strings, or too big to print
    expression = to_regex(printed)
    if expression is None:
        return None
    try:
        body = spell(expression, lambda symbols: _class(alphabet.ranges(symbols)))
    except Unsupported:
        return None
    return None if len(body) > MAX_PRINTED else f"^(?:{body})$"


def _without_newline_twins(language: Dfa, alphabet: _Alphabet) -> Dfa | None:
    """``L'`` = the strings ``s`` of ``language`` whose ``s + "\\n"`` is in it too, when
    ``L' ∪ L'·"\\n"`` is ``language``; else None. The post-validator reads a printed
    ``^(?:R)$`` as ``R ∪ R·"\\n"`` (its ``$`` takes a final newline) where the backends read
    ``R``: printing ``L'`` gives ``language`` to the first and ``L' ⊆ language`` to the
    others, so neither reading lets through a string outside ``language``."""
    newline = alphabet.symbol(NEWLINE)
    before_newline = Dfa(
        language.delta,
        frozenset(s for s, row in enumerate(language.delta) if row[newline] in language.finals),
    )
    twins = minimal(product(language, before_newline, True, MAX_BUILT))
    # twins·"\n": the twins' states, flagged when the last symbol was a newline out of a final
    size = len(twins.delta)
    delta = tuple(
        tuple(t + size * (symbol == newline and s in twins.finals) for symbol, t in enumerate(row))
        for s, row in enumerate(twins.delta)
    )
    appended = Dfa(delta + delta, frozenset(range(size, 2 * size)))
    union = product(twins, appended, False, MAX_BUILT)
    same = (
        product(union, language.complement(), True, MAX_BUILT).empty()
        and product(language, union.complement(), True, MAX_BUILT).empty()
    )
    return twins if same else None


def _positions(node: Node) -> int:
    """Atoms with repetitions unrolled (an unbounded one counted once more than its minimum)."""
    if isinstance(node, Chars):
        return 1
    if isinstance(node, Anchor):
        return 0
    if isinstance(node, Repeat):
        times = max(node.low, 1) if node.high is None else max(node.high, 1)
        return min(_positions(node.item) * times, 10 * MAX_POSITIONS)
    assert isinstance(node, Alt)
    return sum(_positions(n) for option in node.options for n in option)


def _classes(trees: list[Alt]) -> list[Chars]:
    out: list[Chars] = []

    def visit(node: Node) -> None:
        if isinstance(node, Chars):
            out.append(node)
        elif isinstance(node, Repeat):
            visit(node.item)
        elif isinstance(node, Alt):
            for option in node.options:
                for item in option:
                    visit(item)

    for tree in trees:
        visit(tree)
    return out


class _Alphabet:
    """The coarsest split of all code points into blocks that every class is a union of."""

    def __init__(self, classes: list[Chars]) -> None:
        distinct = list(dict.fromkeys(classes))
        cuts = sorted(
            {0, 0x110000} | {x for c in distinct for a, b in c.ranges for x in (a, b + 1)}
        )
        index = {cut: i for i, cut in enumerate(cuts)}
        signatures: list[set[int]] = [set() for _ in range(len(cuts) - 1)]
        for number, chars in enumerate(distinct):
            for a, b in chars.ranges:
                for piece in range(index[a], index[b + 1]):
                    signatures[piece].add(number)
        blocks: dict[frozenset[int], list[tuple[int, int]]] = {}
        for piece, signature in enumerate(signatures):
            blocks.setdefault(frozenset(signature), []).append((cuts[piece], cuts[piece + 1] - 1))
        self.blocks = list(blocks.values())
        self._symbols_of = {
            chars: frozenset(i for i, sig in enumerate(blocks) if number in sig)
            for number, chars in enumerate(distinct)
        }

    def writable_chars(self, controls: bool = True) -> Chars:
        """Every block but the surrogates' (and, ``controls`` False, the control characters';
        the alphabet always splits both off)."""
        kept = [r for block in self.blocks for r in block if not 0xD800 <= r[0] <= 0xDFFF]
        if not controls:
            kept = [r for r in kept if r[0] > CONTROLS.ranges[0][1]]
        return Chars(tuple(sorted(kept)))

    def dfa(self, node: Node) -> Dfa:
        return from_tree(node, self.symbols, len(self.blocks), MAX_BUILT, self.symbol(NEWLINE))

    def symbols(self, chars: Chars) -> frozenset[int]:
        """The blocks ``chars`` covers (every class seen at construction is a union of them)."""
        known = self._symbols_of.get(chars)
        if known is not None:
            return known
        return frozenset(i for i, block in enumerate(self.blocks) if _contains(chars, block[0][0]))

    def symbol(self, chars: Chars) -> int:
        """The one block of a class that is a block of its own (``NEWLINE``)."""
        (symbol,) = self._symbols_of[chars]
        return symbol

    def ranges(self, symbols: frozenset[int]) -> list[tuple[int, int]]:
        """The code point ranges of a set of blocks, merged, surrogates left out."""
        picked = sorted(r for i in symbols for r in self.blocks[i] if not 0xD800 <= r[0] <= 0xDFFF)
        merged: list[tuple[int, int]] = []
        for a, b in picked:
            if merged and merged[-1][1] + 1 == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        return merged


def _contains(chars: Chars, code: int) -> bool:
    return any(a <= code <= b for a, b in chars.ranges)


def _class(ranges: list[tuple[int, int]]) -> str:
    if not ranges:
        raise Unsupported("an empty class (only surrogates) reached the printer")
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        char = chr(ranges[0][0])
        if char.isascii() and char.isalnum():
            return char
    body = "".join(
        _class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}" for a, b in ranges
    )
    return f"[{body}]"


def _class_char(code: int) -> str:
    """ASCII letters and digits and printable non-ASCII characters as themselves, every other
    BMP character as ``\\uXXXX`` (xgrammar misreads a range between escaped punctuation such
    as ``\\[-\\^``)."""
    char = chr(code)
    if (char.isascii() and char.isalnum()) or (not char.isascii() and char.isprintable()):
        return char
    return f"\\u{code:04x}" if code < 0x10000 else char
