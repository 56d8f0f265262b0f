"""A regex constraint is read as Python's ``regex`` module reads it: a backend whose own syntax
reads a construct otherwise refuses the regex (``auto`` then tries the next one), so no backend
accepts a text the regex does not match. Each refused case took such a text before."""

from __future__ import annotations

import json
from typing import Any

import pytest

from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import GrammarError, InvalidGrammarError, UnsupportedGrammarError
from espalier.constrained.postvalidate import postvalidate
from espalier.constrained.regex_dialect import (
    MAX_REPEAT,
    dot_without_newline,
    lark_token_reference,
    names_surrogate,
    repeat_size,
    rust_misreading,
    without_end_anchors,
    xgrammar_misreading,
)
from espalier.constrained.schema.guard import admit_schema
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.structural_tag import admit_structural_tag, structural_tag_spec

# (pattern, a text the backend took that Python's regex does not fully match)
RUST_MISREAD = [
    ("[^[:alpha:]]", "é"),  # ASCII POSIX class in Rust, Unicode in Python's regex module
    ("[a-z&&[^aeiou]]", "b"),  # a set operation
    ("[[a]b]", "b"),  # a nested class
    ("a*+a", "a"),  # possessive in Python: matches nothing
    ("(ab)*+ab", "ab"),
    ("a{1, 3}", "a"),  # a literal in Python
    ("(?R)a", "a"),  # recursion in Python, CRLF mode in Rust
]
XGRAMMAR_MISREAD = [
    ("\\D", "٣"),
    ("[^\\w]", "é"),
    ("\\s", "\ufeff"),
    ("[\\^]", "a"),
    ("[[:alpha:]]", ":]"),
    ("a^b", "ab"),
    ("\\012", "\x0012"),
    ("[\\012]{3}", "221"),  # an octal escape in a class
    ("[\\1]{2}", "11"),
    ("[\\p{Greek}]{2}", "Ge"),  # a property in a class: read as its letters
    ("[^\\p{L}\\p{N}]{1,8}", "ab"),
]
COMMON = [
    "[0-9]{3}-[0-9]{4}",
    "(yes|no|maybe)",
    "[A-Z][a-z]+( [A-Z][a-z]+)*",
    "\\d+(\\.\\d+)?",
    "[\\w.-]+@[\\w-]+\\.[a-z]{2,}",
    "^abc$",
    "a.c",
]


def python_matches(pattern: str, text: str) -> bool:
    """The post-validator's reading (``(?R)a`` recurses without end there: no match)."""
    result = postvalidate(GrammarSpec.regex(pattern), text)
    return result.checked and result.valid


@pytest.mark.parametrize(("pattern", "text"), RUST_MISREAD)
def test_rust_backends_refuse_what_they_read_otherwise(
    pattern: str, text: str, toy_tokenizer: Any
) -> None:
    assert not python_matches(pattern, text)
    assert rust_misreading(pattern) is not None
    for backend in ("llguidance", "outlines_core"):
        with pytest.raises(UnsupportedGrammarError, match="reads"):
            compile_grammar(GrammarSpec.regex(pattern), toy_tokenizer, backend)


@pytest.mark.parametrize(("pattern", "text"), XGRAMMAR_MISREAD)
def test_xgrammar_refuses_what_it_reads_otherwise(
    pattern: str, text: str, toy_tokenizer: Any
) -> None:
    assert not python_matches(pattern, text)
    assert xgrammar_misreading(pattern) is not None
    with pytest.raises(UnsupportedGrammarError, match="xgrammar reads"):
        compile_grammar(GrammarSpec.regex(pattern), toy_tokenizer, "xgrammar")


@pytest.mark.parametrize("pattern", COMMON)
def test_common_regexes_stay_on_every_backend(pattern: str, toy_tokenizer: Any) -> None:
    assert rust_misreading(pattern) is None and xgrammar_misreading(pattern) is None
    _stays_on_both(GrammarSpec.regex(pattern), toy_tokenizer)


def _stays_on_both(spec: GrammarSpec, tokenizer: Any) -> None:
    """``spec`` compiles on llguidance and on xgrammar, each when asked by name."""
    for backend in ("llguidance", "xgrammar"):
        assert compile_grammar(spec, tokenizer, backend)[1].backend == backend


@pytest.mark.parametrize("pattern", ["\\p{L}+", "\\p{Lu}\\p{Ll}+", "\\P{L}+"])
def test_a_property_before_a_quantifier_is_not_a_possessive(
    pattern: str, toy_tokenizer: Any
) -> None:
    """``\\p{L}+``: the ``}`` ends the escape; refused everywhere as ``}+`` before."""
    assert rust_misreading(pattern) is None
    _compiled, report = compile_grammar(GrammarSpec.regex(pattern), toy_tokenizer, "auto")
    assert report.backend == "llguidance"


@pytest.mark.parametrize("pattern", ["a{1,3}{2}", "\\x{1F600}", "a(b", "[a-"])
def test_a_regex_pythons_module_does_not_compile_is_invalid(pattern: str) -> None:
    """A regex means what Python's ``regex`` module reads; ``a{1,3}{2}`` wrote ``aaaaaa`` on
    llguidance before."""
    with pytest.raises(InvalidGrammarError, match="invalid regex at line 1, column"):
        GrammarSpec.regex(pattern)


def test_a_recursive_regex_is_unchecked_not_an_error() -> None:
    result = postvalidate(GrammarSpec.regex("a|(?R)"), "")
    assert not result.checked and "could not be checked" in result.errors[0]


def test_xgrammars_dot_no_longer_takes_a_newline(toy_tokenizer: Any) -> None:
    assert dot_without_newline("a.c[.]\\.") == "a[^\\n]c[.]\\."
    assert dot_without_newline("(?s)a.c") == "(?s)a.c"  # DOTALL: Python's dot takes it too
    compiled, _ = compile_grammar(GrammarSpec.regex("a.c"), toy_tokenizer, "xgrammar")
    assert compiled.matcher().completes(toy_tokenizer.encode("abc"))
    assert not compiled.matcher().completes(toy_tokenizer.encode("a\nc"))


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.regex(r"\ud800"),
        GrammarSpec.json_schema({"type": "string", "pattern": r"^\uD83D$"}),
        GrammarSpec.ebnf(r"root ::= [\uD800-\uDFFF]"),
    ],
)
def test_a_surrogate_code_point_is_refused_everywhere(
    spec: GrammarSpec, toy_tokenizer: Any
) -> None:
    # xgrammar compiled these and wrote the code point's bytes (not UTF-8), status OK; the
    # Rust backends refuse them, so auto has no backend left
    with pytest.raises(UnsupportedGrammarError, match="surrogate"):
        compile_grammar(spec, toy_tokenizer, "xgrammar")
    with pytest.raises(GrammarError):
        compile_grammar(spec, toy_tokenizer)


def test_names_surrogate_reads_escapes_not_escaped_backslashes() -> None:
    assert names_surrogate(r"\ud800") and names_surrogate(r"\U0000DC00")
    assert names_surrogate(r"\\\udfff")  # an escaped backslash, then the escape
    assert names_surrogate(r"\\ud800") is None  # a backslash, then "ud800"
    assert names_surrogate(r"[\u0000-\uffff]😀") is None


@pytest.mark.parametrize(
    ("pattern", "copies"),
    [
        ("a{10}", 10),
        ("(?:a{100}){1000}", 100_000),  # nested counts multiply
        ("[a-z]{5}(b{3}){4}", 12),  # a class, then a counted group
        ("a{2,}", 2),
        ("a{,7}", 7),
        ("a{}", 1),  # a literal "{}"
        (r"\{5}", 1),  # an escaped brace: no count
        (r"[{]{9}", 9),
        (r"\p{L}{3}", 3),  # the property's braces are no count
        ("(a|b{2}){3}", 6),
        ("((a{2}){3}){4}", 24),
        ("(?:x{10}|y{20}){3}", 60),
        ("a{1,3}b{7}", 7),
        ("^(?!.*://)((.{1,63}\\.){1,127}[a-z0-9-]+)$", 8001),  # the largest in JSONSchemaBench
    ],
)
def test_repeat_size_multiplies_nested_counts(pattern: str, copies: int) -> None:
    assert repeat_size(pattern) == copies


@pytest.mark.parametrize("pattern", ["a{100000000}", "(?:a{1000}){1000}", "x{4294967295}"])
def test_a_regex_asking_for_too_many_copies_is_refused_uncompiled(pattern: str) -> None:
    """Python's regex module writes a counted literal out in full (``a{100000000}``: tens of
    GB): such a pattern is refused before anything compiles it, as a regex and as a pattern."""
    assert repeat_size(pattern) > MAX_REPEAT
    with pytest.raises(InvalidGrammarError, match="copies of one atom"):
        GrammarSpec.regex(pattern)
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
    with pytest.raises(InvalidGrammarError, match="copies of one atom") as caught:
        admit_schema(json.dumps(schema))
    assert caught.value.pointer == "/properties/a/pattern"
    names = {"type": "object", "patternProperties": {pattern: {}}}
    with pytest.raises(InvalidGrammarError, match="copies of one atom"):
        admit_schema(json.dumps(names))
    assert repeat_size(f"a{{{MAX_REPEAT}}}") == MAX_REPEAT
    GrammarSpec.regex(f"a{{{MAX_REPEAT}}}")  # the limit itself is taken


def _lark_terminal(pattern: str) -> str:
    return "start: /" + pattern.replace("/", "\\/") + "/"


@pytest.mark.parametrize(
    ("pattern", "text"), [*XGRAMMAR_MISREAD, ("\\W{1,4}", "新品"), ("\\Aa", "Aa")]
)
def test_a_lark_terminal_is_read_like_a_regex_constraint_on_xgrammar(
    pattern: str, text: str, toy_tokenizer: Any
) -> None:
    """Held-out sweep: ``/\\W{1,40}/`` wrote CJK letters on xgrammar, ``/\\Aa/`` wrote ``Aa``
    (the regex guards skipped Lark terminals)."""
    assert not python_matches(pattern, text)
    with pytest.raises(UnsupportedGrammarError, match=r"xgrammar reads .* in the terminal"):
        compile_grammar(GrammarSpec.lark(_lark_terminal(pattern)), toy_tokenizer, "xgrammar")


@pytest.mark.parametrize(("pattern", "text"), RUST_MISREAD[:3])
def test_a_lark_terminal_is_read_like_a_regex_constraint_on_llguidance(
    pattern: str, text: str, toy_tokenizer: Any
) -> None:
    with pytest.raises(UnsupportedGrammarError, match=r"llguidance reads .* in the terminal"):
        compile_grammar(GrammarSpec.lark(_lark_terminal(pattern)), toy_tokenizer, "llguidance")


def test_strings_and_comments_of_a_lark_grammar_are_not_terminals(toy_tokenizer: Any) -> None:
    grammar = 'start: "[[:a" x // a /\\D/ comment\nx: /[a-z]+/ "\\\\D/"'
    _stays_on_both(GrammarSpec.lark(grammar), toy_tokenizer)


@pytest.mark.parametrize("pattern", ["a\\Z", "\\Ga", "\\D"])
def test_a_structural_tags_regex_is_read_like_a_regex_constraint_on_xgrammar(
    pattern: str, toy_tokenizer: Any
) -> None:
    """Held-out sweep: ``<`` ``a\\Z`` ``>`` wrote ``<aZ>`` on xgrammar (and on auto)."""
    fmt = {"type": "sequence", "elements": [{"type": "const_string", "value": "<"},
                                             {"type": "regex", "pattern": pattern}]}  # fmt: skip
    spec = structural_tag_spec({"type": "structural_tag", "format": fmt})
    with pytest.raises(UnsupportedGrammarError, match="xgrammar reads"):
        compile_grammar(spec, toy_tokenizer, "xgrammar")
    lark = {"type": "grammar", "syntax": "lark", "grammar": _lark_terminal(pattern)}
    spec = structural_tag_spec({"type": "structural_tag", "format": lark})
    with pytest.raises(UnsupportedGrammarError, match="xgrammar reads"):
        compile_grammar(spec, toy_tokenizer, "xgrammar")


@pytest.mark.parametrize(
    ("kind", "grammar"),
    [
        ("ebnf", 'root ::= "a"{1000000}'),
        ("ebnf", 'root ::= (("ab"{100}){100}){100}'),
        ("ebnf", 'root ::= x{1000}\nx ::= "a" [b-c]{1000}'),
        ("lark", 'start: "a"~1000000'),
        ("lark", "start: /a{1000000}/"),
        ("lark", 'start: x~100\nx: ("ab"~100)~100'),
        ("lark", 'start: x~1000\nx: y\n  | "b"\ny: /a{200}/ "c"~2'),
    ],
)
def test_a_grammar_asking_for_too_many_copies_is_refused_uncompiled(
    kind: str, grammar: str
) -> None:
    """Held-out sweep: ``root ::= "a"{1000000}`` held every request's steps for a minute
    (the limit covered regexes only)."""
    with pytest.raises(InvalidGrammarError, match="copies of one item"):
        GrammarSpec.ebnf(grammar) if kind == "ebnf" else GrammarSpec.lark(grammar)
    tag = {"type": "structural_tag",
           "format": {"type": "grammar", "grammar": grammar, "syntax": kind}}  # fmt: skip
    with pytest.raises(InvalidGrammarError, match="copies of one item") as caught:
        admit_structural_tag(json.dumps(tag), 64)
    assert caught.value.pointer == "/format"


@pytest.mark.parametrize(
    ("kind", "grammar"),
    [
        ("ebnf", 'root ::= "a"{99999} x{3}\nx ::= [0-9]{1,20}'),
        ("ebnf", 'root ::= "a" root{5} | "b"'),  # recursion counts once
        ("lark", '?start: item+\nitem: /[a-z]{1,20}/ "x"~3..5 // ~ 99999999\n%ignore " "'),
    ],
)
def test_ordinary_counts_in_grammars_stay(kind: str, grammar: str) -> None:
    GrammarSpec.ebnf(grammar) if kind == "ebnf" else GrammarSpec.lark(grammar)


def test_a_deeply_nested_gbnf_is_refused_with_a_message() -> None:
    with pytest.raises(InvalidGrammarError, match="nested too deeply"):
        GrammarSpec.ebnf("root ::= " + "(" * 5000 + '"a"' + ")" * 5000)


def test_a_structural_tag_regex_error_without_a_column_names_none() -> None:
    tag = {"type": "structural_tag", "format": {"type": "regex", "pattern": "a{1000000}"}}
    with pytest.raises(InvalidGrammarError) as caught:
        admit_structural_tag(json.dumps(tag), 64)
    assert "column None" not in str(caught.value)


@pytest.mark.parametrize(
    ("pattern", "text", "other"),
    [("[a-z]+$", "abc", "ab1"), ("^foo$", "foo", "fo"), ("abc$", "abc", "abcd"),
     ("^a|b$", "b", "ab")],
)  # fmt: skip
def test_end_anchors_let_an_outlines_regex_end(
    pattern: str, text: str, other: str, toy_tokenizer: Any
) -> None:
    """Held-out sweep: ``[a-z]+$`` never ended on outlines-core (its regex is followed by an
    end marker, where ``$`` does not hold), and ``^foo$`` / ``abc$`` were refused with its
    internal messages."""
    compiled, _ = compile_grammar(GrammarSpec.regex(pattern), toy_tokenizer, "outlines_core")
    assert grammar_accepts(compiled, toy_tokenizer, text)
    assert not grammar_accepts(compiled, toy_tokenizer, other)


@pytest.mark.parametrize("pattern", ["a$b", "(a$)", "\\bfoo\\b", "(x\\Z)", "(\\Ax)"])
def test_other_anchors_go_past_outlines(pattern: str, toy_tokenizer: Any) -> None:
    """(A leading ``\\A`` and a trailing ``\\Z`` are dropped before any backend:
    ``regex_dialect.backend_spelling``.)"""
    assert without_end_anchors(pattern) is None
    with pytest.raises(UnsupportedGrammarError, match="an anchor inside the regex"):
        compile_grammar(GrammarSpec.regex(pattern), toy_tokenizer, "outlines_core")


def test_escaped_and_class_dollars_are_not_anchors() -> None:
    assert without_end_anchors("a\\$") == "a\\$"
    assert without_end_anchors("[$^]x$") == "[$^]x"
    assert without_end_anchors("\\\\$") == "\\\\"


@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar"])
@pytest.mark.parametrize("grammar", ["start: <[0-100]>\n", 'start: "a" <|eot|>\n'])
def test_a_lark_token_reference_is_refused(
    grammar: str, backend: str, gemma_tokenizer: Any
) -> None:
    """``start: <[0-100]>`` ended INTERNAL on llguidance (its mask allowed ids its matcher then
    refused: "the grammar rejected sampled token 43"), and xgrammar read it as something else
    (its mask allowed ``<eos>`` and ``[multimodal]``): refused by name on both."""
    with pytest.raises(UnsupportedGrammarError, match="token reference"):
        compile_grammar(GrammarSpec.lark(grammar), gemma_tokenizer, backend)
    assert lark_token_reference('start: "<[1]>" /<[a]>/ // <|x|>\n') is None


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize(
    "imports",
    [
        "%import common.ESCAPED_STRING",
        "%import common (WS, ESCAPED_STRING)\n%ignore WS",
        "%import common.ESCAPED_STRING -> ESCAPED_STRING",
    ],
)
def test_lark_common_escaped_string_means_what_lark_means(
    backend: str, imports: str, toy_tokenizer: Any
) -> None:
    """A held-out sweep: ``start: ESCAPED_STRING`` wrote strings with raw newlines on both
    backends (their libraries' definition), finish ``stop``, which Lark's own (``.`` without a
    newline) refuses. The import is spelled as Lark means it (``own_common_terminals``)."""
    compiled, _ = compile_grammar(
        GrammarSpec.lark(f"start: ESCAPED_STRING\n{imports}"), toy_tokenizer, backend
    )
    for text, ok in [('"x y"', True), ('"a\\"b"', True), ('""', True), ('"x\ny"', False)]:
        matcher = compiled.matcher()
        ids = toy_tokenizer.encode_text(text)
        taken = matcher.accept_tokens(ids) == len(ids) and matcher.can_terminate()
        assert taken == ok, (text, backend)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines_core"])
def test_python_spellings_no_backend_reads_are_respelled(backend: str, toy_tokenizer: Any) -> None:
    """A held-out sweep: ``a{,3}`` (0 to 3) and ``\\Aabc\\Z`` were refused on every backend,
    auto included. They are written ``a{0,3}`` and ``abc`` (the same in a full match)."""
    cases = [("xa{,3}", ["x", "xaaa"], ["xaaaa"]), ("\\Aabc\\Z", ["abc"], ["abcabc"])]
    for pattern, texts, others in cases:
        compiled, _ = compile_grammar(GrammarSpec.regex(pattern), toy_tokenizer, backend)
        assert all(grammar_accepts(compiled, toy_tokenizer, text) for text in texts)
        assert not any(grammar_accepts(compiled, toy_tokenizer, text) for text in others)


@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar", "outlines_core"])
@pytest.mark.parametrize("pattern", ["(?=a)a", "(a)\\1"])
def test_a_python_regex_a_backend_cannot_read_is_unsupported_not_invalid(
    backend: str, pattern: str, toy_tokenizer: Any
) -> None:
    """A held-out sweep: outlines-core refused lookarounds and backreferences with "Failed to
    build DFA error building NFA", and auto called them invalid with a backend's parse error
    of its own wrapper grammar. Python's regex module reads them: each backend says it does
    not (UnsupportedGrammarError), naming what it cannot read."""
    with pytest.raises(UnsupportedGrammarError) as caught:
        compile_grammar(GrammarSpec.regex(pattern), toy_tokenizer, backend)
    assert "does not read" in str(caught.value) or "reads" in str(caught.value)


def test_a_schema_pattern_llguidance_cannot_read_is_unsupported_not_invalid(
    toy_tokenizer: Any,
) -> None:
    """JSONSchemaBench's hugo.json: a ``patternProperties`` name with a lookahead (beside open
    additional properties, so not printed from the pattern algebra) was called an invalid
    schema, with llguidance's parse error of it. Every schema pattern is Python-valid at
    admission: llguidance says it does not read it."""
    from tests.fixtures.jsonschemabench import bench_dir

    hugo = json.loads((bench_dir() / "JsonSchemaStore" / "hugo.json").read_text())["schema"]
    cascade = {"definitions": hugo["definitions"], "$ref": "#/definitions/cascade"}
    with pytest.raises(UnsupportedGrammarError, match="does not read a pattern of the schema"):
        compile_grammar(GrammarSpec.json_schema(cascade), toy_tokenizer, "llguidance")
