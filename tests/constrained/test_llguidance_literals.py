"""llguidance does not take a grammar with a literal over MAX_LITERAL_BYTES (its masks cost O(n)
inside one); ``auto`` compiles such grammars on the next backend, and short literals stay."""

from __future__ import annotations

from typing import Any

import pytest

from espalier.constrained.backends.llguidance.literals import (
    MAX_LITERAL_BYTES,
    grammar_literal,
    hanging_terminal,
    longest_literal,
    regex_literal,
    schema_literal,
)
from espalier.constrained.compile import compile_grammar
from espalier.constrained.errors import UnsupportedGrammarError
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.structural_tag import structural_tag_spec

LONG = MAX_LITERAL_BYTES + 100


@pytest.mark.parametrize(
    ("pattern", "length"),
    [
        ("a{30000}", 30000),  # a fixed count of a literal: one literal
        ("(ab){3000}", 6000),
        ("((ab){100}){100}", 20000),  # nested counts multiply
        ("^x(?:ab){2}y$", 6),  # anchors take no bytes; a fixed group joins the run
        ("(abc){1000,1001}", 3000),  # at least the minimum is fixed
        ("a{0,30000}", 1),  # an open count is no literal
        ("[ab]{30000}", 0),  # nor is a class
        (".{0,9999}", 0),
        (r"^\d{3}-\d{4}$", 1),
        ("é{10}", 20),  # bytes, not characters
        ("a{1000000}", 1000000),
        (r"\p{L}{5000}", 4),  # Python cannot read it: the longest plain run ("5000") counts
        ("(?<name>ab){3000}", 12000),  # nor this: a count after a group counts 4 bytes a time
        ("a{99999999999}", 4 * 99999999999),  # past Python's count limit: the same estimate
    ],
)
def test_regex_literal(pattern: str, length: int) -> None:
    assert regex_literal(pattern) == length


def test_schema_literal_counts_compiled_strings_only() -> None:
    assert schema_literal({"const": "y" * 100}) == 102  # quoted
    assert schema_literal({"enum": [1, {"k" * 50: ["v" * 70]}]}) == 72
    assert schema_literal({"properties": {"x" * 50: {"type": "integer"}}}) == 52
    assert schema_literal({"patternProperties": {"^a{500}$": {}}}) == 500
    assert schema_literal({"items": {"anyOf": [{"pattern": "b{300}"}]}}) == 300
    assert schema_literal({"$defs": {"d": {"const": "z" * 40}}}) == 42
    # annotations are not compiled, whatever their size
    big = "n" * 10 * MAX_LITERAL_BYTES
    assert schema_literal({"description": big, "examples": [big], "default": big}) == 0


def test_grammar_literal_reads_strings_counts_and_terminals() -> None:
    assert grammar_literal('start: "ab"{5000} | /a{300}/') == 10000
    assert grammar_literal('start: \'xyz\' | %json {"const": "' + "q" * 90 + '"}') == 90
    assert grammar_literal('root ::= "ab" [a-z]{0,100000}') == 2


def test_longest_literal_of_each_kind() -> None:
    assert longest_literal(GrammarSpec.choice(["a" * 20, "b"])) == 20
    assert longest_literal(GrammarSpec.any_json()) == 0
    tag = structural_tag_spec(
        {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": "c" * 33},
                    {"type": "json_schema", "json_schema": {"const": "d" * 44}},
                ],
            },
        }
    )
    assert longest_literal(tag) == 46


@pytest.mark.parametrize(
    ("spec", "valid"),
    [
        (GrammarSpec.choice(["ab" * (LONG // 2), "x"]), "ab" * (LONG // 2)),
        (GrammarSpec.regex(f"a{{{LONG}}}"), "a" * LONG),
        # the largest count a regex may ask for (regex_dialect.MAX_REPEAT): 100 KB of "a"
        (GrammarSpec.regex("a{100000}"), "a" * 100000),
        (GrammarSpec.json_schema({"const": "v" * LONG}), '"' + "v" * LONG + '"'),
    ],
    ids=["choice", "regex", "regex-huge", "const"],
)
def test_llguidance_refuses_a_long_literal_and_auto_takes_xgrammar(
    toy_tokenizer: Any, spec: GrammarSpec, valid: str
) -> None:
    with pytest.raises(UnsupportedGrammarError, match=r"a literal of \d+ bytes, over 4096"):
        compile_grammar(spec, toy_tokenizer, "llguidance")
    compiled, report = compile_grammar(spec, toy_tokenizer)
    assert report.backend == "xgrammar"
    tokens = toy_tokenizer.encode(valid)
    assert compiled.matcher().completes(tokens)
    assert not compiled.matcher().completes(tokens[:-1])


def test_short_literals_and_long_annotations_stay_on_llguidance(toy_tokenizer: Any) -> None:
    schema = {
        "description": "d" * 3 * MAX_LITERAL_BYTES,
        "enum": ["v" * (MAX_LITERAL_BYTES - 10), "w"],
    }
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert report.backend == "llguidance"
    text = '"w"'
    assert compiled.matcher().completes(toy_tokenizer.encode(text))


@pytest.mark.parametrize(
    ("lark", "hangs"),
    [
        ("start: /a+/ /a/", True),  # each True one never finished a mask in llguidance 1.9.1
        ('start: / +/ " "', True),
        ("start: /[a]+/ /a/", True),
        ("start: /(ab)+/ /ab/", True),
        ("start: /a{2,}/ /a/", True),
        ("start: /ba+/ /a/", True),
        ("start: /a*/ /a/", False),  # these finished: an open class, or no minimum
        ("start: /[a-z]+/ /x/", False),
        ('start: /[0-9]+/ "0"', False),
        ('start: "a"+', False),  # a rule's repetition, no terminal's
        ('start: %json {"pattern": "^/api/"}', False),
    ],
)
def test_hanging_terminal(lark: str, hangs: bool) -> None:
    assert (hanging_terminal(lark) is not None) is hangs


def test_a_hanging_terminal_is_refused_on_llguidance_and_auto_takes_xgrammar(
    toy_tokenizer: Any,
) -> None:
    """``"c"`` passes the start mask; llguidance's next mask never returned, stalling every
    request of the engine."""
    spec = GrammarSpec.lark('start: "b" | "c" /a+/ /a/')
    with pytest.raises(UnsupportedGrammarError, match="repeats one string without bound"):
        compile_grammar(spec, toy_tokenizer, "llguidance")
    compiled, report = compile_grammar(spec, toy_tokenizer)
    assert report.backend == "xgrammar"
    assert compiled.matcher().completes(toy_tokenizer.encode("b"))
    tag = structural_tag_spec(
        {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [
                    {"type": "regex", "pattern": "x+"},
                    {"type": "const_string", "value": "x"},
                ],
            },
        }
    )
    with pytest.raises(UnsupportedGrammarError, match="repeats one string"):
        compile_grammar(tag, toy_tokenizer, "llguidance")
