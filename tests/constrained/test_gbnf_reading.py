"""GBNF read as llama.cpp reads it, on both backends that take it.

- llguidance makes character-only rules greedy lexemes (``gbnf_to_lark``); where that loses
  texts (``gbnf_lexing.greedy_loss``) it refuses the grammar, and ``auto`` goes on to xgrammar.
- xgrammar reads ``\\xHH`` past two digits and refuses empty alternatives and ``.``; its GBNF is
  respelled (``xgrammar/gbnf.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance
import pytest
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from espalier.constrained import bitmask as bm
from espalier.constrained import gbnf
from espalier.constrained.backends import get_backend
from espalier.constrained.backends.llguidance.gbnf_lexing import TOO_LARGE, greedy_loss
from espalier.constrained.backends.xgrammar.gbnf import xgrammar_gbnf
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import InvalidGrammarError, UnsupportedGrammarError
from espalier.constrained.spec import GrammarSpec

GBNF_DIR = Path(__file__).resolve().parents[3] / "shared" / "conformance" / "grammars" / "gbnf"

ARITHMETIC = """root  ::= (expr "=" ws term "\\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \\t\\n]*
"""

WORDS = " | ".join(f'"word{i:04d}"' for i in range(900))

# (grammar, where greedy lexing reads it short, a text of the grammar llguidance's reading
# loses): each loss is checked against llguidance itself below
LOSSY = [
    (ARITHMETIC, None, "a=b\n"),
    ('root ::= "a" body "z"\nbody ::= [ -~]*', "rule 'body'", "abz"),
    ('root ::= word " " word\nword ::= [a-z ]+', "rule 'word'", "ab cd"),
    ('root ::= x "x"\nx ::= "x"+', "rule 'x'", "xxx"),
    ('root ::= item "c"\nitem ::= [a-c]{1,3}', "rule 'item'", "abc"),
    # two lexemes allowed at one place, one continuing the other's complete text
    ('root ::= ("a" | "aa") "a"', "literal 'a'", "aa"),
    ('root ::= [a-z]+ "xy"', "a character class", "axyxy"),
    ('root ::= ([a-z] | " ")* "end"', "a character class", "x ending end"),
    ('root ::= a | b "bc"\na ::= "ab"\nb ::= "a"', "rule 'b'", "abc"),
    # a large terminal
    (f'root ::= id "\\n"\nid ::= ({WORDS}) ws\nws ::= [ \\n]*', "rule 'id'", "word0001\n"),
]
# (grammar, a text of it): no loss claimed, and llguidance's reading keeps the text
KEPT = [
    ('root ::= num "." num\nnum ::= [0-9]+', "12.34"),
    ('root ::= word " " word\nword ::= [a-z]+', "ab cd"),
    ('root ::= "a" [ -~]* "z"', "abz"),  # inline: one-character lexemes, no greedy reading
    ('root ::= str ":" str\nstr ::= "\\"" [^"]* "\\"" ws\nws ::= [ ]*', '"a" :"b"'),
    ('root ::= (kw | [0-9])+\nkw ::= "if" | "in"', "if1in"),
]


def _llguidance_reads(grammar: str, text: str, tokenizer: Any) -> bool:
    """Whether llguidance's own reading of ``grammar`` (its converter, no espalier check)
    takes ``text`` whole and may end there."""
    backend = get_backend("llguidance", tokenizer)
    lltokenizer = backend.lltokenizer  # type: ignore[attr-defined]
    matcher = llguidance.LLMatcher(lltokenizer, gbnf_to_lark(grammar), log_level=0)
    ids = tokenizer.encode(text)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize(("grammar", "where", "text"), LOSSY)
def test_a_greedy_loss_is_named_and_is_real(
    grammar: str, where: str | None, text: str, toy_tokenizer: Any
) -> None:
    found = greedy_loss(grammar)
    assert found is not None and found != TOO_LARGE
    assert where is None or found == where
    assert not _llguidance_reads(grammar, text, toy_tokenizer)
    with pytest.raises(UnsupportedGrammarError, match="greedy lexer may lose texts"):
        compile_grammar(GrammarSpec.ebnf(grammar), toy_tokenizer, "llguidance")
    compiled, report = compile_grammar(GrammarSpec.ebnf(grammar), toy_tokenizer, "auto")
    assert report.backend == "xgrammar"
    assert compiled.matcher().completes(toy_tokenizer.encode(text))


@pytest.mark.parametrize(("grammar", "text"), KEPT)
def test_no_loss_is_claimed_where_llguidance_keeps_the_text(
    grammar: str, text: str, toy_tokenizer: Any
) -> None:
    assert greedy_loss(grammar) is None
    assert _llguidance_reads(grammar, text, toy_tokenizer)


@pytest.mark.skipif(not GBNF_DIR.is_dir(), reason="conformance grammars not present")
def test_the_conformance_grammars_are_read_and_two_lose_texts(toy_tokenizer: Any) -> None:
    found = {}
    for path in sorted(GBNF_DIR.glob("*.gbnf")):
        text = path.read_text()
        gbnf.parse(text)  # every one is read (a read failure would silence the check)
        found[path.name] = greedy_loss(text)
    assert found.pop("arithmetic.gbnf") in ("rule 'ident'", "rule 'num'", "rule 'ws'")
    # a real loss: "int" read as an identifier (a variable named int) before whitespace
    assert found.pop("c.gbnf") == "rule 'identifier'"
    c_text = "int f(){int = 1;}"
    assert not _llguidance_reads((GBNF_DIR / "c.gbnf").read_text(), c_text, toy_tokenizer)
    assert len(found) >= 7 and set(found.values()) == {None}


def test_a_rule_defined_twice_is_read_as_the_converter_reads_it(toy_tokenizer: Any) -> None:
    """``gbnf_to_lark`` keeps the last definition: so does the check."""
    grammar = 'root ::= num "\\n"\nnum ::= [0-9]+ ws\nws ::= "x"\nws ::= [ \\n]*'
    assert greedy_loss(grammar) == "rule 'num'"
    assert not _llguidance_reads(grammar, "1\n", toy_tokenizer)
    with pytest.raises(UnsupportedGrammarError, match="greedy lexer may lose texts"):
        compile_grammar(GrammarSpec.ebnf(grammar), toy_tokenizer, "llguidance")


def test_unreadable_text_makes_no_claim() -> None:
    assert greedy_loss('root ::= "a" (') is None
    assert greedy_loss("not gbnf at all") is None


def test_classes_and_escapes_read_as_llama_cpp_reads_them() -> None:
    rules = gbnf.parse(
        'root ::= [^a-c\\x41] "\\x41BC\\u00e9\\t" [\\]-] x{2,} x{,3} x?\nx ::= "" | [\\U0001F600]'
    )
    body = rules["root"]
    assert isinstance(body, gbnf.Seq)
    cls, lit, close, two, three, opt = body.items
    assert cls == gbnf.CharSet(gbnf.complement(((0x41, 0x41), (0x61, 0x63))))
    assert lit == gbnf.Text("ABC\u00e9\t")
    assert close == gbnf.CharSet(((0x2D, 0x2D), (0x5D, 0x5D)))
    assert (two, three, opt) == (
        gbnf.Repeat(gbnf.Ref("x"), 2, None),
        gbnf.Repeat(gbnf.Ref("x"), 0, 3),
        gbnf.Repeat(gbnf.Ref("x"), 0, 1),
    )
    assert rules["x"] == gbnf.Alt((gbnf.Text(""), gbnf.CharSet(((0x1F600, 0x1F600),))))


@pytest.mark.parametrize(
    ("grammar", "texts", "not_texts"),
    [
        ('root ::= "\\x41BC"', ["ABC"], ["\u41bc"]),
        ('root ::= [\\x41-\\x43]+ "\\x0a"', ["AB\n"], ["D\n"]),
        ('root ::= "a" ws "b"\nws ::= | " "', ["ab", "a b"], ["a  b"]),
        ('root ::= "a" ( | "x" | ) "b"', ["ab", "axb"], ["ayb"]),
        ('root ::= "<" . ">"', ["<x>", "<\n>", "<\u00e9>"], ["<>"]),
        ('root ::= "\\[" [\\]x] "\\]"', ["[]]", "[x]"], ["[y]"]),
    ],
)
def test_xgrammar_reads_gbnf_as_llama_cpp_does(
    grammar: str, texts: list[str], not_texts: list[str], toy_tokenizer: Any
) -> None:
    compiled, _ = compile_grammar(GrammarSpec.ebnf(grammar), toy_tokenizer, "xgrammar")
    for text in texts:
        assert compiled.matcher().completes(toy_tokenizer.encode(text)), text
    for text in not_texts:
        assert not compiled.matcher().completes(toy_tokenizer.encode(text)), text


def test_xgrammar_respelling_keeps_literals_classes_and_comments() -> None:
    source = 'root ::= "|(" [|)] # a | comment\n  | "\\x7f"\n'
    assert xgrammar_gbnf(source) == 'root ::= "|(" [|)] # a | comment\n  | "\\u007f"\n'
    assert xgrammar_gbnf("root ::= x |\nx ::= ( )") == 'root ::= x | ""\nx ::= ( "" )'
    assert xgrammar_gbnf('x ::= "b" | # empty') == 'x ::= "b" | "" # empty'


def test_a_short_hex_escape_is_refused_on_xgrammar(toy_tokenizer: Any) -> None:
    with pytest.raises(InvalidGrammarError, match="two hex digits"):
        compile_grammar(GrammarSpec.ebnf('root ::= "\\x4"'), toy_tokenizer, "xgrammar")


def test_an_inline_repeat_of_a_wide_class_masks_on_llguidance(gemma_tokenizer: Any) -> None:
    """One-character lexemes over printable ASCII: ~100,000 Earley items a mask on the Gemma
    vocabulary, past llguidance's default limit (its second mask failed "Too many items")."""
    compiled, _ = compile_grammar(
        GrammarSpec.ebnf('root ::= "a" [ -~]* "z"'), gemma_tokenizer, "llguidance"
    )
    matcher = compiled.matcher()
    bitmask = torch.zeros((1, bm.words_per_row(gemma_tokenizer.vocab_size)), dtype=torch.int32)
    for token in gemma_tokenizer.encode("a quick brown fox z"):
        matcher.fill_bitmask(bitmask, 0)
        assert bm.is_allowed(bitmask[0], token)
        assert matcher.accept(token)
    assert matcher.can_terminate()


def test_a_structural_tags_gbnf_element_is_checked_too(toy_tokenizer: Any) -> None:
    """A tag's ``grammar`` element goes through the same converter on llguidance."""
    from espalier.constrained.structural_tag import structural_tag_spec

    spec = structural_tag_spec(
        {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": "calc:"},
                    {"type": "grammar", "grammar": ARITHMETIC},
                ],
            },
        }
    )
    with pytest.raises(UnsupportedGrammarError, match="greedy lexer may lose texts"):
        compile_grammar(spec, toy_tokenizer, "llguidance")
    compiled, report = compile_grammar(spec, toy_tokenizer, "auto")
    assert report.backend == "xgrammar"
    assert compiled.matcher().completes(toy_tokenizer.encode("calc:a=b\n"))


def test_a_dot_takes_a_newline_on_llguidance(toy_tokenizer: Any) -> None:
    """``gbnf_to_lark`` writes ``.`` as ``/./``, which leaves out ``\\n`` in Rust."""
    grammar = GrammarSpec.ebnf('root ::= "<" . ">"')
    compiled, _ = compile_grammar(grammar, toy_tokenizer, "llguidance")
    for text in ("<\n>", "<x>"):
        assert compiled.matcher().completes(toy_tokenizer.encode(text)), text


@pytest.mark.parametrize(
    ("grammar", "texts", "not_texts"),
    [
        ("root ::= [^a&&b]", ["c", "^"], ["a", "&", "b"]),
        ("root ::= [a~~b]", ["~", "a"], ["c"]),
        ("root ::= [*--]", ["+", ","], ["a"]),
    ],
)
def test_a_class_rust_reads_as_a_set_operation_goes_to_xgrammar(
    grammar: str, texts: list[str], not_texts: list[str], toy_tokenizer: Any
) -> None:
    with pytest.raises(UnsupportedGrammarError, match="set operation"):
        compile_grammar(GrammarSpec.ebnf(grammar), toy_tokenizer, "llguidance")
    compiled, report = compile_grammar(GrammarSpec.ebnf(grammar), toy_tokenizer, "auto")
    assert report.backend == "xgrammar"
    for text in texts:
        assert compiled.matcher().completes(toy_tokenizer.encode(text)), text
    for text in not_texts:
        assert not compiled.matcher().completes(toy_tokenizer.encode(text)), text


def test_a_grammar_past_the_checks_work_budget_counts_as_lossy(toy_tokenizer: Any) -> None:
    """The check's work is bounded (``MAX_WORK``): 5,000 literals at one place pass it, and
    llguidance refuses what it could not check (2,000 were checked, a fraction of a second)."""
    words = " | ".join(f'"w{i}"' for i in range(5000))
    grammar = f'root ::= ({words}) " " root | "end"'
    assert greedy_loss(grammar) == TOO_LARGE
    with pytest.raises(UnsupportedGrammarError, match="too large for the check"):
        compile_grammar(GrammarSpec.ebnf(grammar), toy_tokenizer, "llguidance")
    fewer = " | ".join(f'"w{i}"' for i in range(2000))
    assert greedy_loss(f'root ::= ({fewer}) " " root | "end"') is None


@pytest.mark.parametrize(
    ("grammar", "inside", "outside"),
    [
        ('root ::= "\\u004100"', ["A00"], ["\u4100", "A"]),
        ('root ::= "\\u00e900"', ["\u00e900"], ["\ue900"]),
        ("root ::= [\\u0400-\\u04FF]+", ["\u0400\u04ff"], ["a", "\u4ff0"]),
        ('root ::= "\\U0001F600" "x"', ["\U0001f600x"], ["\U0001f600"]),
        ('root ::= [\\u005d\\u002d]+ "\\u0022"', ['-]"'], ["a"]),
    ],
)
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_wide_escapes_take_exactly_their_digits(
    grammar: str, inside: list[str], outside: list[str], backend: str, toy_tokenizer: Any
) -> None:
    """llama.cpp reads exactly 4 (``\\u``) or 8 (``\\U``) hex digits; ``gbnf_to_lark`` drops
    leading zeros, so llguidance wrote ``\\u4100`` for ``"\\u004100"`` (held-out sweep, a false
    accept) and refused ``[\\u0400-\\u04FF]``."""
    compiled, _ = compile_grammar(GrammarSpec.ebnf(grammar), toy_tokenizer, backend)
    for text in inside:
        assert grammar_accepts(compiled, toy_tokenizer, text), text
    for text in outside:
        assert not grammar_accepts(compiled, toy_tokenizer, text), text
