"""Where the greedy closing search finds no path, the fallback (``engine/closing/backtrack.py``)
does, and the output closes valid within its budget.

The three schemas are small copies of what ``bench/validity.py`` traced with the embedded model
(max_tokens 256, ``length_unclosed`` before): the greedy search writes optional keys in
declared order before the required ones, and in one of them a pattern string it cannot end
(Github_medium/o90224, ``KML``), or more of them than the budget holds (Github_hard/o21330,
``OPTIONAL_FIRST``), or a ``\\d+\\s`` pattern whose whitespace it takes last
(JsonSchemaStore/ruleset_schema, ``RULESET``). Toy tokenizer (a real byte-level BPE), tiny
random-weight model for the engine run.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from espalier.constrained.compile import compile_grammar
from espalier.constrained.keys import with_unique_keys
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import ConstraintOptions, FinishReason, GenerationRequest, SamplingParams
from espalier.engine.closing import ClosingPaths
from tests.fixtures.closing_feed import closed_output
from tests.fixtures.engine_fixtures import make_engine, run_all, text_of, toy_tokenizer

KML = {
    "type": "object",
    "additionalProperties": False,
    "anyOf": [
        {"required": ["id", "layerType", "title", "url"]},
        {"required": ["id", "layerType", "path", "title"]},
    ],
    "properties": {
        "id": {"type": "string"},
        "itemId": {"type": "string"},
        "layerType": {"enum": ["KML"], "type": "string"},
        "listMode": {"enum": ["hide", "show"], "type": "string"},
        "maxScale": {"type": "number", "minimum": 0},
        "opacity": {"type": "number"},
        "path": {"type": "string", "pattern": "^file:.+\\.km[lz]$"},
        "title": {"type": "string"},
        "url": {"type": "string"},
        "visibility": {"type": "boolean"},
    },
}
OPTIONAL_FIRST = {
    "type": "object",
    "additionalProperties": False,
    "required": ["base_path", "details", "title"],
    "properties": {
        **{f"a{i:02d}_optional": {"type": "string"} for i in range(12)},
        "base_path": {"type": "string", "pattern": "^/[a-z]*$"},
        "bulk": {"type": "boolean"},
        "details": {
            "type": "object",
            "additionalProperties": False,
            "required": ["body"],
            "properties": {
                "attachments": {"type": "array"},
                "body": {"type": "string"},
                "caption": {"type": "string"},
            },
        },
        "note": {"type": "string"},
        "title": {"type": "string"},
    },
}
RULESET = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["hosts", "sources", "rules"],
        "properties": {
            "default_events_ttl": {
                "type": "string",
                "pattern": "^\\d+\\s(seconds?|minutes?|hours?|days?)$",
            },
            "hosts": {"type": "string"},
            "sources": {"type": "array"},
            "rules": {"type": "array"},
        },
    },
}
# (schema, where the looping model starts, the backends that compile it exactly)
CASES: dict[str, tuple[dict[str, Any], str, list[str]]] = {
    "kml": (KML, '{"id": "1', ["llguidance"]),  # xgrammar weakens this anyOf: refused
    "optional_first": (OPTIONAL_FIRST, '{"a00_optional": "1', ["llguidance", "xgrammar"]),
    "ruleset": (RULESET, '[{"default_events_ttl": "1', ["llguidance", "xgrammar"]),
}
PARAMS = [(name, backend) for name, case in CASES.items() for backend in case[2]]
LIMIT = 120


def matcher_of(schema: dict[str, Any], backend: str) -> Any:
    """A matcher as the engine makes it (the duplicate-key tracker around the grammar's)."""
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, backend)
    return with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)


@pytest.mark.parametrize(("name", "backend"), PARAMS)
def test_the_fallback_finds_a_path_where_the_greedy_search_finds_none(
    name: str, backend: str
) -> None:
    schema = CASES[name][0]
    tokenizer = toy_tokenizer()
    matcher = matcher_of(schema, backend)
    paths = ClosingPaths(tokenizer)
    assert paths.search(matcher.fork(), LIMIT) is None  # the greedy walk alone: none
    path = paths.find(matcher, LIMIT)
    assert path is not None and len(path) <= LIMIT
    probe = matcher.fork()
    assert probe.accept_tokens(path) == len(path) and probe.can_terminate()
    value = json.loads(b"".join(tokenizer.token_bytes[t] for t in path).decode())
    jsonschema.validate(value, schema)
    if name != "ruleset":  # only the required keys (the optional ones come first in order)
        assert "title" in value and not any(key.startswith("a0") for key in value)


@pytest.mark.parametrize(("name", "backend"), PARAMS)
def test_a_model_that_loops_in_a_string_is_closed_valid(name: str, backend: str) -> None:
    """The embedded model's outputs: ``{"id": "1000…`` until max_tokens (``length_unclosed``
    before: no closing path from any state, so the policy never closed)."""
    schema, head, _ = CASES[name]
    tokenizer = toy_tokenizer()
    text = tokenizer.encode(head + "0" * 400)
    value = closed_output(schema, backend, 80, text.__getitem__)
    assert value is not None  # closed_output validated it against the schema


def test_where_the_greedy_search_finds_a_path_it_is_the_one_returned() -> None:
    """The fallback runs only where the greedy search returns None: every state along a valid
    output gets the greedy path itself (its choices stay the definition)."""
    tokenizer = toy_tokenizer()
    paths = ClosingPaths(tokenizer)
    text = tokenizer.encode('{"a00_optional": "x", "base_path": "/ab", "details": {"body": "y"}')
    matcher = matcher_of(OPTIONAL_FIRST, "llguidance")
    greedy_found = 0
    for token in text:
        greedy = paths.search(matcher.fork(), LIMIT)
        if greedy is not None:
            greedy_found += 1
            assert paths.find(matcher, LIMIT) == greedy
        assert matcher.accept(token)
    assert greedy_found > 0


@pytest.mark.parametrize("max_tokens", [48, 96])
def test_the_engine_closes_every_output_valid(max_tokens: int) -> None:
    """The tiny random-weight model through the real engine: every output of the three
    schemas ends valid (post-validated), none cut unclosed."""
    engine = make_engine()
    requests = [
        GenerationRequest(
            f"{name}-{backend}-{k}",
            prompt=prompt,
            sampling=SamplingParams(max_tokens=max_tokens),
            grammar=GrammarSpec.json_schema(schema),
            constraint=ConstraintOptions(backend=backend),
        )
        for name, (schema, _, backends) in CASES.items()
        for backend in backends
        for k, prompt in enumerate(["abc", '{"id": 1'])
    ]
    outputs = run_all(engine, requests)
    for request in requests:
        chunks = outputs[request.request_id]
        last = chunks[-1]
        assert last.finish_reason is not FinishReason.LENGTH_UNCLOSED, request.request_id
        assert last.validation is not None and last.validation.valid, request.request_id
        assert request.grammar is not None
        jsonschema.validate(json.loads(text_of(chunks)), json.loads(request.grammar.source))
