"""Calendar formats become exact patterns (``rewrite.FORMAT_PATTERNS``): through every backend
chosen by name, strict mode, they accept what ``jsonschema``'s format check accepts on a few
edge cases, and nothing it rejects (xgrammar once took ``12:00:001Z``: a fraction without dot)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from espalier.constrained.backends import BACKENDS, BackendUnavailableError, get_backend
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import GrammarError
from espalier.constrained.postvalidate import validate_instance
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
