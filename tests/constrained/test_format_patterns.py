"""Calendar formats become exact patterns (``rewrite.FORMAT_PATTERNS``): through every backend
chosen by name, strict mode, they accept what ``jsonschema``'s format check accepts on a few
edge cases, and nothing it rejects (xgrammar once took ``12:00:001Z``: a fraction without dot).
``uri-reference`` becomes its checker's own expression (``schema.checker_patterns``)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from espalier.constrained.backends import BACKENDS, BackendUnavailableError, get_backend
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import GrammarError
from espalier.constrained.postvalidate import validate_instance
from espalier.constrained.schema.checker_patterns import checker_pattern
from espalier.constrained.spec import GrammarSpec

CASES = {
    "date-time": [
        "2022-01-01T12:00:00Z",
        "2022-01-01T12:00:00.25+01:00",
        "2022-01-01T12:00:001Z",
        "2022-01-01T12:00:0012Z",
        "2022-01-01T12:00:00.Z",
        "2024-02-29t23:59:59z",
        "2023-02-29T12:00:00Z",
    ],
    "time": ["12:00:00Z", "12:00:00.5-05:30", "12:00:001Z", "12:00:00"],
    "date": ["2024-02-29", "2023-02-29", "2024-1-01"],
}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", list(CASES))
def test_calendar_formats_agree_with_the_format_checker(
    backend: str, name: str, toy_tokenizer: Any
) -> None:
    try:
        get_backend(backend, toy_tokenizer)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    schema = {"type": "string", "format": name}
    try:
        compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend)
    except GrammarError:
        assert backend == "outlines_core", f"{backend} refuses format {name}"
        return
    for text in CASES[name]:
        expected = validate_instance(schema, text).valid
        got = grammar_accepts(compiled, toy_tokenizer, json.dumps(text))
        assert got == expected, (name, text, expected)


URI_REFERENCES = ["http://a/b?c#d", "//[::1]:80/x", "../a%20b", "a:b", "%zz", "http://[v1.a]/",
                  "", "#frag", "a b", "http://1.2.3.4:8/", "//h/[", "ü", "\\x", "?q=/"]  # fmt: skip


def test_uri_reference_is_its_checkers_own_expression(toy_tokenizer: Any) -> None:
    """The pattern is the checker's language (``rfc3986_validator``, jsonschema's checker for
    ``uri-reference`` without ``rfc3987``) on random strings, and llguidance (``auto``'s pick)
    accepts exactly the valid ones (a final newline aside)."""
    import regex
    from rfc3986_validator import validate_rfc3986

    pattern = checker_pattern("uri-reference")
    assert pattern is not None
    rng = random.Random(8)
    pool = list("ab:/?#[]@!$&'()*+,;=%09AF.-_~ \n\"\\é")
    texts = URI_REFERENCES + ["".join(rng.choices(pool, k=rng.randrange(10))) for _ in range(3000)]
    for text in texts:
        assert bool(regex.search(pattern, text)) == bool(validate_rfc3986(text, "URI_reference"))
    schema = {"type": "string", "format": "uri-reference"}
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert report.backend == "llguidance"
    valid = 0
    for text in texts[:400]:
        expected = validate_instance(schema, text).valid
        got = grammar_accepts(compiled, toy_tokenizer, json.dumps(text, ensure_ascii=False))
        assert got == expected or (expected and text.endswith("\n")), text
        valid += got
    assert valid > 20


URI_TEMPLATES = ["http://example.com/{path}{?query,page}", "{+base}/x{#frag}", "/a{/b*}{;c:3}",
                 "{.dom*}{&x,y:12}", "plain text", "", "{a=1}", "{%20}", "{,a}", "{a,}", "{}",
                 "{ab", "a}", "{a:0}", "{a:1000}", "{a*:3}", "{=a}", "{!a}", "{|a}",
                 "{a b}"]  # fmt: skip


def _template_like(rng: random.Random) -> str:
    """A random string near the template syntax: expressions of names, operators, modifiers,
    with a random character swapped in now and then."""
    parts = []
    for _ in range(rng.randrange(4)):
        if rng.random() < 0.3:
            parts.append("".join(rng.choices("ab/:%9 .", k=rng.randrange(4))))
            continue
        names = ",".join(
            rng.choice(["a", "b.c", "_9", "x:3", "y*", "z:0", "q=1", "%41", "a/b", "w[]", ""])
            for _ in range(rng.randrange(1, 3))
        )
        parts.append("{" + rng.choice(["", "", "+", "#", ".", "/", ";", "?", "&", ",", "=", "@"])
                     + names + rng.choice(["", "", ",", ".", "*"]) + "}")  # fmt: skip
    text = "".join(parts)
    if text and rng.random() < 0.3:
        at = rng.randrange(len(text))
        text = text[:at] + rng.choice("{}:*,.=%a1 \n") + text[at + 1 :]
    return text


def test_uri_template_pattern_is_within_its_checker(toy_tokenizer: Any) -> None:
    """The ``uri-template`` pattern takes only what the checker (``uri_template.validate``,
    jsonschema's) takes, on random template-like strings, and most real templates; llguidance
    (``auto``'s pick) compiles it and accepts exactly the pattern's strings."""
    import regex
    import uri_template

    from espalier.constrained.schema.rewrite import FORMAT_PATTERNS

    pattern = FORMAT_PATTERNS["uri-template"]
    rng = random.Random(35)
    texts = URI_TEMPLATES + [_template_like(rng) for _ in range(5000)]
    matched = [text for text in texts if regex.search(pattern, text)]
    assert all(uri_template.validate(text) for text in matched)
    assert len(matched) > 1000  # the pattern is not a sliver of the checker's language
    assert all(regex.search(pattern, text) for text in URI_TEMPLATES[:6])
    schema = {"type": "string", "format": "uri-template"}
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert report.backend == "llguidance" and report.weakened == ()
    accepted = 0
    for text in texts[:300]:  # a final newline is a literal character here: no two readings
        got = grammar_accepts(compiled, toy_tokenizer, json.dumps(text, ensure_ascii=False))
        assert got == (regex.search(pattern, text) is not None), text
        accepted += got
    assert accepted > 50


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_uri_template_never_accepts_what_its_checker_rejects(
    backend: str, toy_tokenizer: Any
) -> None:
    """Through each backend by name, strict mode: no template the checker rejects gets through
    (outlines-core refuses the pattern: it may match a character JSON escapes)."""
    try:
        get_backend(backend, toy_tokenizer)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    schema = {"type": "string", "format": "uri-template"}
    try:
        compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend)
    except GrammarError:
        assert backend == "outlines_core", f"{backend} refuses format uri-template"
        return
    rng = random.Random(6570)
    texts = URI_TEMPLATES + [_template_like(rng) for _ in range(150)]
    accepted = 0
    for text in texts:
        if grammar_accepts(compiled, toy_tokenizer, json.dumps(text, ensure_ascii=False)):
            assert validate_instance(schema, text).valid, text
            accepted += 1
    assert accepted > 20
