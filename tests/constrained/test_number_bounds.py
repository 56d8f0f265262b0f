"""The JSON number policy (``constrained/schema/number_bounds.py``): bounded digits, every backend.

Each backend compiles schemas with the default ``BackendOptions`` (bounds on) and with
``json_number_bounds=None`` (the libraries' own unbounded grammars), on the toy byte-level
tokenizer. Oracle: whatever a bounded grammar accepts, the unbounded one accepts too and the
caller's schema validates (the policy only narrows).
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from espalier.constrained.backends import BACKENDS, BackendOptions, get_backend
from espalier.constrained.backends.common import BackendUnavailableError
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import GrammarError
from espalier.constrained.schema.features import backend_issues
from espalier.constrained.schema.number_bounds import (
    NumberBounds,
    bound_number_regex,
    bound_schema_numbers,
    clamp_schema_bounds,
)
from espalier.constrained.spec import GrammarSpec

UNBOUNDED = BackendOptions(json_number_bounds=None)
TWENTY_DIGITS = "12345678901234567890"


def compiled(backend: str, schema: dict[str, Any], tokenizer: Any, options: Any = None) -> Any:
    try:
        engine = get_backend(backend, tokenizer, options)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    return engine.compile(GrammarSpec.json_schema(schema))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_twenty_digit_integer_is_refused_by_default_and_accepted_when_off(
    backend: str, toy_tokenizer: Any
) -> None:
    for schema in ({"type": "integer"}, {"type": "integer", "minimum": 0}, {"type": "number"}):
        bounded = compiled(backend, schema, toy_tokenizer)
        unbounded = compiled(backend, schema, toy_tokenizer, UNBOUNDED)
        assert not grammar_accepts(bounded, toy_tokenizer, TWENTY_DIGITS), (backend, schema)
        assert grammar_accepts(unbounded, toy_tokenizer, TWENTY_DIGITS), (backend, schema)
        assert grammar_accepts(bounded, toy_tokenizer, "123456789012345"), (backend, schema)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fractions_and_exponents_are_bounded(backend: str, toy_tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    bounded = compiled(backend, schema, toy_tokenizer)
    unbounded = compiled(backend, schema, toy_tokenizer, UNBOUNDED)
    for text, ok in (("0.125", True), ("-3.141592", True), ("1.1234567", False), ("2e+5", False)):
        assert grammar_accepts(bounded, toy_tokenizer, f'{{"x": {text}}}') is ok, (backend, text)
        assert grammar_accepts(unbounded, toy_tokenizer, f'{{"x": {text}}}'), (backend, text)


SCHEMAS = [
    {"type": "integer"},
    {"type": "integer", "minimum": 0},
    {"type": "integer", "maximum": -5},
    {"type": "integer", "multipleOf": 3},
    {"type": "number", "multipleOf": 0.25},
    {"type": "number"},
    {"type": "number", "minimum": 2.5},
    {"type": "number", "exclusiveMaximum": 0},
    {"type": ["integer", "null"]},
    {"type": "array", "items": {"type": "number"}, "maxItems": 2},
]


def random_number_text(rng: random.Random) -> str:
    sign = rng.choice(["", "-"])
    digits = rng.choice([1, 2, 5, 15, 16, 17, 20])
    whole = str(rng.randint(1, 9)) + "".join(rng.choice("0123456789") for _ in range(digits - 1))
    if rng.random() < 0.3:
        whole = "0"
    text = sign + whole
    if rng.random() < 0.4:
        text += "." + "".join(rng.choice("0123456789") for _ in range(rng.choice([1, 3, 6, 7])))
    if rng.random() < 0.15:
        text += rng.choice(["e5", "E-2", "e+12"])
    return text


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounded_grammars_accept_only_what_the_schema_and_the_unbounded_grammar_accept(
    backend: str, toy_tokenizer: Any
) -> None:
    rng = random.Random(5)
    for schema in SCHEMAS:
        if backend_issues(backend, schema):
            continue  # bounds this backend does not enforce (strict mode never picks it)
        bounded = compiled(backend, schema, toy_tokenizer)
        unbounded = compiled(backend, schema, toy_tokenizer, UNBOUNDED)
        validator = jsonschema.Draft202012Validator(schema)
        accepted = 0
        for _ in range(60):
            texts = [random_number_text(rng) for _ in range(2)]
            text = texts[0] if schema.get("type") != "array" else f"[{', '.join(texts)}]"
            if not grammar_accepts(bounded, toy_tokenizer, text):
                continue
            accepted += 1
            assert grammar_accepts(unbounded, toy_tokenizer, text), (backend, schema, text)
            assert validator.is_valid(json.loads(text)), (backend, schema, text)
        assert accepted > 0, (backend, schema)


def test_keywords_go_only_where_narrowing_narrows() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"not": {"type": "integer"}},
            "c": {"type": "integer", "enum": [10**30]},
            "d": {"type": "integer", "minimum": 10**20},
        },
        "$defs": {"n": {"type": "number"}},
    }
    out = bound_schema_numbers(schema, "xgrammar", NumberBounds())
    props = out["properties"]
    assert props["a"] == {"type": "integer", "minimum": -(2**53 - 1), "maximum": 2**53 - 1}
    assert props["b"] == schema["properties"]["b"]  # under "not": narrowing would widen
    assert props["c"] == schema["properties"]["c"]  # finite already
    assert props["d"] == {"type": "integer", "minimum": 10**20}  # a maximum would empty it
    assert out["$defs"] == schema["$defs"]  # a "not" somewhere: shared definitions untouched


def test_several_types_split_into_one_branch_per_type() -> None:
    out = bound_schema_numbers(
        {"type": ["number", "null"], "title": "t"}, "llguidance", NumberBounds(10, 3, 2)
    )
    assert out == {
        "title": "t",
        "anyOf": [
            {
                "type": "number",
                "exclusiveMinimum": -1000,
                "exclusiveMaximum": 1000,
                "multipleOf": 0.01,
            },
            {"type": "null"},
        ],
    }


def test_regex_substitution_replaces_numbers_before_integers() -> None:
    integer_rx, number_rx = "(-)?(0|[1-9][0-9]*)", r"((-)?(0|[1-9][0-9]*))(\.[0-9]+)?"
    regex = f"\\[{number_rx},{integer_rx}\\]"
    bounds = NumberBounds(integer_limit=999, number_integer_digits=2, number_fraction_digits=1)
    out = bound_number_regex(regex, integer_rx, number_rx, bounds)
    assert out == r"\[(?:(-)?(0|[1-9][0-9]{0,1})(\.[0-9]{1,1})?),(?:(-)?(0|[1-9][0-9]{0,2}))\]"


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        NumberBounds(integer_limit=2**63 - 1)
    assert NumberBounds().integer_digits == 15
    assert NumberBounds(integer_limit=999).integer_digits == 3


def test_bounds_past_what_backends_read_are_clamped_only_where_narrowing_narrows() -> None:
    past = {"type": "integer", "minimum": 0, "maximum": 2**64 - 1}
    schema = {
        "type": "object",
        "properties": {
            "a": past,
            "b": {"not": past},
            "c": {"type": ["integer", "null"], "minimum": -(10**20)},
            "d": {"type": "number", "exclusiveMaximum": 3.7e19, "minimum": 1},
            "e": {"type": "integer", "minimum": 2**60, "maximum": 2**61},
            "f": {"type": "integer", "maximum": 2**53},
        },
    }
    out = clamp_schema_bounds(schema, NumberBounds())["properties"]
    assert out["a"] == {"type": "integer", "minimum": 0, "maximum": 2**53 - 1}
    assert out["b"] == schema["properties"]["b"]  # under "not": narrowing would widen
    assert out["c"] == {"type": ["integer", "null"], "minimum": -(2**53 - 1)}
    assert out["d"] == {"type": "number", "exclusiveMaximum": 10**15, "minimum": 1}
    assert out["e"] == schema["properties"]["e"]  # clamping would empty it: left as it is
    assert out["f"] == schema["properties"]["f"]  # read exactly: the caller's own bound
    small = clamp_schema_bounds(past, NumberBounds(integer_limit=1000))
    assert small == {"type": "integer", "minimum": 0, "maximum": 1000}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_an_int64_maximum_compiles_under_the_policy_and_stays_refused_without_it(
    backend: str, toy_tokenizer: Any
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 2**63}}, "required": ["n"]}  # fmt: skip
    grammar, _ = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend)
    validator = jsonschema.Draft202012Validator(schema)
    for value, ok in ((0, True), (2**53 - 1, True), (2**53, False), (2**63, False), (-1, False)):
        text = json.dumps({"n": value})
        assert grammar_accepts(grammar, toy_tokenizer, text) is ok, (backend, value)
        assert not ok or validator.is_valid({"n": value})
    with pytest.raises(GrammarError):
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend, options=UNBOUNDED)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "exclusiveMinimum": 0.5},
        {"type": "integer", "minimum": -2.5, "exclusiveMaximum": 3.5},
        {"type": "integer", "maximum": -0.5, "exclusiveMaximum": 2},
        {"type": ["integer", "string"], "exclusiveMinimum": 0.5},
    ],
)
def test_fractional_bounds_on_integers_take_exactly_the_schemas_integers(
    backend: str, schema: dict[str, Any], toy_tokenizer: Any
) -> None:
    """xgrammar refused a fractional bound on an integer; the policy writes the whole bounds
    that take the same integers, on every backend it bounds."""
    grammar = compiled(backend, schema, toy_tokenizer)
    validator = jsonschema.Draft202012Validator(schema)
    for value in range(-5, 6):
        text = str(value)
        assert grammar_accepts(grammar, toy_tokenizer, text) == validator.is_valid(value), text


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        ({"type": "number", "minimum": 0.1, "maximum": 0.1}, "0.1"),
        ({"type": "number", "minimum": -2.2, "maximum": -2.2}, "-2.2"),
        ({"type": "number", "exclusiveMinimum": 0.25, "exclusiveMaximum": 0.2500009}, "0.2500001"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_a_range_narrower_than_the_fraction_step_is_not_emptied(
    backend: str, schema: dict[str, Any], value: str, toy_tokenizer: Any
) -> None:
    # the fraction policy's multipleOf 1e-6 made llguidance call these empty ("range
    # [0.10000099999999999, 0.09999999999999999] does not contain a multiple of 0.000001"),
    # and its emptiness check refused them on every backend
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend)
    assert grammar_accepts(compiled, toy_tokenizer, value)
