"""The regular-language algebra over ``pattern`` (:mod:`regular`), against the ``regex`` oracle.

For a pattern ``p`` and its complement ``c`` (or an intersection), on random strings: the
post-validator's reading of ``c`` (``regex.search``) equals the computed language exactly (the
strings ``p`` matches, or fails to match, under both readings of ``\\d`` / ``\\w`` / ``\\s``: its
own, Unicode, and ECMA-262's, ASCII), and
the backends' reading (a full match of the ``^...$`` body) never takes a string outside it.
Random patterns come from a small generator (literals, classes, ``\\d`` / ``\\w`` / ``\\s``,
``.``, groups, alternations, ``* + ? {m,n}``, anchors); strings mix ASCII, Unicode digits and
letters, newlines and an astral character.
"""

from __future__ import annotations

import random
import time

import pytest
import regex

from espalier.constrained.schema.pattern_parse import Unsupported, search_language
from espalier.constrained.schema.regular import complement_pattern, intersect_patterns

READINGS = ("", "(?a)")  # the post-validator's classes, and ECMA-262's (ASCII)
CHARS = [*"ab1590+=.$/:{}-\\ _xZé", "\n", "\t", "\u0660", "\u2028", "\U0001d7ce", "😀"]


def random_string(rng: random.Random, extra: str = "") -> str:
    pool = CHARS + list(extra)
    return "".join(rng.choice(pool) for _ in range(rng.randrange(9)))


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", "1", r"\d", r"\w", r"\s", r"\S", ".", "[a-c]", "[^a]", r"[\d.]", r"\+", "é"]
    items = []
    for _ in range(rng.randrange(1, 4)):
        if depth < 2 and rng.random() < 0.2:
            inner = "|".join(random_pattern(rng, depth + 1) for _ in range(rng.randrange(1, 3)))
            atom = f"(?:{inner})"
        else:
            atom = rng.choice(atoms)
        atom += rng.choice(["", "", "", "*", "+", "?", "{2}", "{1,3}", "{0,2}", "{2,}"])
        items.append(atom)
    body = "".join(items)
    if depth == 0:
        body = rng.choice(["", "^"]) + body + rng.choice(["", "$"])
    return body


def language_mismatches(
    patterns: list[str], printed: str | bool, negate: bool, seed: int
) -> list[str]:
    """Random strings where ``printed`` disagrees with the language it stands for."""
    rng = random.Random(seed)
    extra = "".join(patterns)
    out = []
    for _ in range(600):
        text = random_string(rng, extra)
        # under both readings of the classes (regular.BOTH_READINGS: Unicode and ASCII)
        wanted = all(
            bool(regex.search(flags + p, text)) != negate for p in patterns for flags in READINGS
        )
        if isinstance(printed, bool):
            searched = full = printed
        else:
            searched = bool(regex.search(printed, text))
            full = bool(regex.fullmatch(printed[1:-1], text))
        if searched != wanted or (full and not wanted):
            out.append(text)
    return out


HAND_PICKED = [
    r"(\+)\w+", r"^[A-Fa-f\d]{4}$", r"^(\.\d+)+\.?$", "^a*$", r".*\{\{.+}}.*", r"^\./.+$",
    "a5b", "(^[^5]*$)|7", "99", "^$", "$", "^", "", "a|", "(a|^b)", "(^a|b$)", "^(a|b)$",
    r"^(?:[01]\d|2[0-3]):[0-5]\d$", r"^https?://.+$", "^([a-z][0-9])+$", r"(\$)", "x{2,3}y?",
    "a{,2}b", "a{}", "[^=]+=.*", r"^\p{Lu}\w*$", r"\s\S", "é+$", "^.{2}$", r"[\]a-]", "[a-c-e]",
    r"^\u00e9\x41$", r"^[^\n]+$", "(?P<name>ab)+c",
]  # fmt: skip


@pytest.mark.parametrize("pattern", HAND_PICKED)
def test_complement_of_hand_picked_patterns(pattern: str) -> None:
    printed = complement_pattern(pattern)
    assert printed is not None, pattern
    assert language_mismatches([pattern], printed, negate=True, seed=1) == []


def test_complement_of_random_patterns() -> None:
    rng = random.Random(7)
    checked = 0
    for _ in range(60):
        pattern = random_pattern(rng)
        printed = complement_pattern(pattern)
        if printed is None:
            continue  # no exact spelling: the keyword stays refused
        checked += 1
        assert language_mismatches([pattern], printed, negate=True, seed=checked) == [], pattern
    assert checked >= 40


def test_intersection_of_random_pairs() -> None:
    rng = random.Random(11)
    checked = empty = 0
    for _ in range(40):
        pair = (random_pattern(rng), random_pattern(rng))
        printed = intersect_patterns(pair)
        if printed is None:
            continue
        checked += 1
        empty += printed is False
        assert language_mismatches(list(pair), printed, negate=False, seed=checked) == [], pair
    assert checked >= 25


@pytest.mark.parametrize(
    ("patterns", "expected"),
    [
        (("^a$", "^b$"), False),
        ((r"^\d+$", "^[a-z]"), False),
        (("a", "b"), "some"),
        ((r"^\w+$", "^x"), "some"),
        (("", "."), "some"),
    ],
)
def test_disjointness_is_decided(patterns: tuple[str, ...], expected: object) -> None:
    printed = intersect_patterns(patterns)
    assert (printed is False) == (expected is False), printed


@pytest.mark.parametrize(
    "pattern",
    [r"(?=a)b", r"(?!a)b", r"(?<=a)b", r"(a)\1", r"\bword\b", "(?i)abc", "a*+", "a{2000}",
     "[[:alpha:]]", "^(?=a)*b", "a(?!b)", "^a(?=b)c", "^(?!(?=a)b)", "\\"],
)  # fmt: skip
def test_syntax_not_read_is_refused_not_guessed(pattern: str) -> None:
    assert complement_pattern(pattern) is None


INNER_ANCHORS_AND_LOOKAHEADS = [
    r"a^b", r"(a$)b", r"(^a)*", r"^(\/?((\.{2})|([a-z0-9\-]*))($|\/))*$", r"^$[a-z$_]*$",
    r"(a|$)b?$", r"^(x$|y)+", r"^(?!a)", r"^(?![aA][bB])[a-z]+$", r"^(?=\d)(?!.*x$)[\d.x]{1,4}$",
    r"((?:[^/]*/)*)(?=\.(yaml|json))", r"^(?!org\.)([a-z_$][a-z\d_$]*\.)*[a-z_$]+$",
]  # fmt: skip


@pytest.mark.parametrize("pattern", INNER_ANCHORS_AND_LOOKAHEADS)
def test_inner_anchors_and_leading_or_final_lookaheads_are_read_exactly(pattern: str) -> None:
    for printed, negate in (
        (complement_pattern(pattern), True),
        (intersect_patterns((pattern,)), False),
    ):
        assert printed is not None, pattern
        assert language_mismatches([pattern], printed, negate=negate, seed=2) == [], pattern


def test_random_patterns_with_inner_anchors_and_lookaheads() -> None:
    rng = random.Random(13)
    checked = 0
    for _ in range(60):
        a, b = random_pattern(rng, 1), random_pattern(rng, 1)
        pattern = rng.choice([f"^(?!{a}){b}", f"^(?={a}){b}$", f"{a}(?={b})", f"(?:{a}|$){b}",
                              f"(?:^|{a}){b}$", f"^(?:{a}$|{b})+"])  # fmt: skip
        printed = intersect_patterns((pattern,))
        if printed is None:
            continue
        checked += 1
        assert language_mismatches([pattern], printed, negate=False, seed=checked) == [], pattern
    assert checked >= 40


def test_a_pattern_that_cannot_be_printed_within_bounds_is_refused_quickly() -> None:
    start = time.monotonic()
    assert complement_pattern("^[0-9a-zA-Z_-]{1,255}$") is None
    assert complement_pattern("^(?:[a-f0-9]{2}:){40}$") is None  # states past the cap
    assert complement_pattern("((c1d3g3).{4,8}){6,6}") is None  # subsets past the cap
    assert time.monotonic() - start < 5


def test_a_language_the_post_validator_cannot_read_back_is_refused() -> None:
    """Strings of whitespace (``\\n`` included) have no complement ``^R$`` can spell: ``""`` is
    in it, ``"\\n"`` is not, and ``$`` takes a final newline."""
    assert complement_pattern(r"^\s+$") is None


@pytest.mark.parametrize("pattern", [r"^\s+$", r"^[\s.]*$", r"^\s{0,2}$", r"^(?:\n|a)+$"])
def test_a_complement_cut_to_a_length_floor_is_exact_above_it(pattern: str) -> None:
    """With ``minLength`` next to the ``not``, the strings shorter than the floor are out
    anyway: the complement is said on the rest, where ``""`` no longer spoils it."""
    rng = random.Random(3)
    for floor in (1, 3):
        printed = complement_pattern(pattern, floor)
        assert isinstance(printed, str), (pattern, floor)
        for _ in range(600):
            text = random_string(rng, pattern)
            wanted = len(text) >= floor and not regex.search(pattern, text)
            assert bool(regex.search(printed, text)) == wanted, (pattern, floor, text)
            assert not regex.fullmatch(printed[1:-1], text) or wanted, (pattern, floor, text)


def test_unicode_classes_follow_the_oracle() -> None:
    tree = search_language(r"^\d$")
    assert tree.options  # parsed
    printed = complement_pattern(r"^\d$")
    assert isinstance(printed, str)
    for digit in ("7", "\u0660", "\U0001d7ce"):  # ASCII, Arabic-Indic, mathematical bold
        assert not regex.search(printed, digit) and regex.search(printed, digit + "x")
    with pytest.raises(Unsupported):
        search_language(r"(?<=x)y")


def test_trivial_languages() -> None:
    assert complement_pattern("") is False  # matches every string
    assert intersect_patterns(("", "x|")) is True
    # the oracle reads [^\s\S] as any character (a quirk of ``regex``), so its complement is
    # {""}, which no "^R$" spells without also taking "\n" under the post-validator's "$"
    assert complement_pattern(r"[^\s\S]") is None
    assert intersect_patterns(("a", "b")) not in (None, True, False)


@pytest.mark.parametrize(
    ("pattern", "kept", "dropped"),
    [
        (r"^(?=b)\w+$", ["b_1", "bZ9"], ["bé", "b\u0660", "b软件"]),
        (r"^(?=[0-9])\d{3,12}$", ["123", "0000"], ["8\u1c54\u09e7", "1\uff10\uff11"]),
        (r"^(?!x)\s+$", [" ", "\t\n "], ["\u00a0", "\u2028"]),
    ],
)
def test_a_printed_pattern_keeps_what_both_readings_of_the_classes_match(
    pattern: str, kept: list[str], dropped: list[str]
) -> None:
    """A held-out sweep: ``^(?=b)\\w+$`` (a lookahead: printed from the algebra) wrote
    ``"botonesivesseällt"`` and ``^(?=[0-9])\\d{3,12}$`` ``"8᱔১৮୭"``: valid to the Unicode
    post-validator, invalid to ECMA-262 validators (JSON Schema's reading, where ``\\w`` is
    ``[A-Za-z0-9_]``). Without a lookahead the backends read ``\\w`` as ASCII already."""
    printed = intersect_patterns((pattern,))
    assert isinstance(printed, str)
    for text in kept:
        assert regex.fullmatch(printed[1:-1], text), (pattern, text)
    for text in dropped:
        assert regex.search(pattern, text), (pattern, text)  # the post-validator takes it
        assert not regex.search(printed, text), (pattern, text)


WORD_PATTERNS = [
    "^(w0|w1|w10)$",
    "^(?:ab|c)d?$",
    "^a\\.b$",
    "^(a|b)c{1,3}$",
    "^[a-d]{2}$",
    "^\\d$",
    "^([a-c]|-)x$",
    "^(ab|cd|ef){1,3}$",
    "^(|a|aa)b?$",
    "^(?:x(?:y|z){0,2}){2}$",
    "^[é-ë]{2}z$",
    "^(a|b)\\s$",
]


@pytest.mark.parametrize("pattern", WORD_PATTERNS)
@pytest.mark.parametrize("readings", [(False,), (True,), (False, True)])
def test_words_listed_from_the_tree_equal_the_automatons(
    pattern: str, readings: tuple[bool, ...]
) -> None:
    """``pattern_words`` lists a finite pattern's words from its tree (no bound on positions);
    the automaton it otherwise reads them from gives the same words, length bounds too."""
    from espalier.constrained.schema.regular import (
        _automaton_words,
        _listed_words,
        pattern_words,
    )

    assert _listed_words(pattern, 4096, readings) is not None  # the tree path is taken
    for lengths in ((0, None), (2, None), (0, 2), (3, 3)):
        listed = pattern_words(pattern, 4096, readings, lengths)
        assert listed == _automaton_words(pattern, 4096, readings, lengths)
        assert all(regex.fullmatch(pattern.strip("^$"), w) for w in listed or ())


def test_a_long_word_list_is_listed_and_caps_hold() -> None:
    from espalier.constrained.schema.regular import _automaton_words, pattern_words

    words = [f"w{i}" for i in range(254)]  # ~1,000 positions: past the automata's bound
    pattern = "^(" + "|".join(words) + ")$"
    assert _automaton_words(pattern, 4096, (False, True), (0, None)) is None
    assert pattern_words(pattern, 4096) == tuple(sorted(words))
    assert pattern_words(pattern, 254) is None  # fewer than the cap, or none
    many = [f"w{i}" for i in range(1, 1001)]  # 5,895 characters: past the automata's 2,000
    assert pattern_words("^(" + "|".join(many) + ")$", 4096) == tuple(sorted(many))
    assert pattern_words("^[a-z]+$", 4096) is None  # infinite
    assert pattern_words("^(a|aa){1,4000}$", 64) is None
    assert pattern_words("^[\\u0000-\\uffff]$", 1 << 20) is None  # surrogates
