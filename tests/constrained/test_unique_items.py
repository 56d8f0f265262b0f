"""``uniqueItems`` over open item domains, enforced at run time (``schema/unique_places.py`` and
the tracker in ``constrained/keys``).

Oracles: ``jsonschema`` on random instance texts (items written many ways: escapes, surrogate
pairs, ``1`` / ``1.0`` / ``1e0``, integers past 2**53, literals), where the wrapped matcher must
accept exactly what the backend's grammar accepts and ``jsonschema`` finds valid; the filtered
row equals the backend's row minus exactly the tokens whose bytes complete a duplicate item
(the Python twin replays each allowed token); strict mode still names each ``uniqueItems`` the
tracker cannot follow, with its pointer.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.compile import compile_grammar, prepare_schema
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import SchemaNotEnforceableError
from espalier.constrained.keys import with_unique_keys
from espalier.constrained.schema.unique_places import MARK, unique_places
from espalier.constrained.spec import GrammarSpec
from tests.fixtures.keys_twin import parse_export, step

STRINGS = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
NUMBERS = {"type": "array", "items": {"type": "number"}, "uniqueItems": True}
SCALARS = {
    "type": "array",
    "items": {"type": ["string", "number", "boolean", "null"]},
    "uniqueItems": True,
}
NESTED = {
    "type": "object",
    "properties": {
        "tags": {"$ref": "#/$defs/tags"},
        "grid": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        },
        "free": {"type": "array", "items": {"type": "string"}},
    },
    "$defs": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    "additionalProperties": False,
}
ITEMS = {
    "string": ['"a"', '"\\u0061"', '"b"', '"ab"', '""', '"\\u0000"', '"\\ud83d\\ude00"',
               '"\U0001f600"', '"null"', '"1"', '"\\""', '"a\\/b"', '"a/b"'],
    "number": ["1", "1.0", "10E-1", "2", "-0", "0", "0.0", "0.1", "0.10000000000000001",
               "100000000000000001", "100000000000000000", "100000000000000000.0", "-1"],
    "literal": ["true", "false", "null"],
}  # fmt: skip
BACKENDS = ["llguidance", "xgrammar"]


def _array(rng: random.Random, kinds: list[str]) -> str:
    pool = [item for kind in kinds for item in ITEMS[kind]]
    items = [rng.choice(pool) for _ in range(rng.randrange(5))]
    if items and rng.random() < 0.5:  # a duplicate, maybe written another way
        items.insert(rng.randrange(len(items) + 1), rng.choice(items))
    return "[" + rng.choice([",", ", "]).join(items) + "]"


def _instance(rng: random.Random, schema: Any) -> str:
    if schema is NESTED:
        grid = "[" + ", ".join(_array(rng, ["number"]) for _ in range(rng.randrange(3))) + "]"
        grid = grid.replace(".0", "").replace("10E-1", "3").replace("0.1", "4")
        return f'{{"tags": {_array(rng, ["string"])}, "grid": {grid}, "free": ["a", "a"]}}'
    kind = schema["items"]["type"]
    return _array(rng, [kind] if isinstance(kind, str) else ["string", "number", "literal"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schema", [STRINGS, NUMBERS, SCALARS, NESTED], ids=lambda s: "")
def test_accepts_exactly_the_valid_instances(backend: str, schema: Any, toy_tokenizer: Any) -> None:
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend)
    assert not report.weakened
    rng = random.Random(7)
    seen = {"valid": 0, "duplicate": 0}
    for _ in range(200):
        text = _instance(rng, schema)
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        inner = compiled.matcher()
        tokens = toy_tokenizer.encode(text)
        grammar = inner.accept_tokens(tokens) == len(tokens) and inner.can_terminate()
        assert grammar_accepts(compiled, toy_tokenizer, text) == (grammar and valid), text
        if grammar:
            seen["valid" if valid else "duplicate"] += 1
    assert seen["valid"] >= 10 and seen["duplicate"] >= 10, seen


def test_filtered_rows_lose_exactly_the_duplicate_completions(toy_tokenizer: Any) -> None:
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCALARS), toy_tokenizer, "llguidance")
    places = unique_places(compiled.spec.schema)
    assert places is not None
    tb = toy_tokenizer.token_bytes
    rng = random.Random(8)
    removed_somewhere = 0
    for _ in range(40):
        text = _instance(rng, SCALARS)
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), toy_tokenizer)
        tokens = toy_tokenizer.encode(text)
        for token in tokens:
            inner = bm.allocate(1, toy_tokenizer.vocab_size, fill=0)
            matcher.inner.fill_bitmask(inner, 0)
            row = bm.allocate(1, toy_tokenizer.vocab_size, fill=0)
            matcher.fill_bitmask(row, 0)
            state = parse_export(matcher.keys.export())
            allowed = np.flatnonzero(bm.unpack_allowed(inner[0].numpy(), len(tb))).tolist()
            dups = {t for t in allowed if step(state, tb[t], places=places) is None}
            kept = set(np.flatnonzero(bm.unpack_allowed(row[0].numpy(), len(tb))).tolist())
            expected = set(allowed) - dups if set(allowed) - dups else set(allowed)
            assert kept == expected, (text, state)
            removed_somewhere += bool(dups)
            if not matcher.accept(token):
                break
    assert removed_somewhere > 20


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"type": "array", "items": {"type": "object"}, "uniqueItems": True}, ""),
        ({"type": "array", "uniqueItems": True}, ""),
        # numbers from a list (strings from one are followed: Places.item_words)
        (
            {"type": "array", "items": {"enum": [i * 7 for i in range(20)]}, "uniqueItems": True},
            "",
        ),
        (  # strings from a list in a prefix position
            {
                "type": "array",
                "prefixItems": [{"enum": ["a", "b", "c"]}],
                "items": {"type": "string"},
                "uniqueItems": True,
            },
            "",
        ),
        (
            {
                "anyOf": [
                    {"type": "array", "items": {"type": "string"}},
                    {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                ]
            },
            "/anyOf/1",
        ),
        ({"not": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}, "/not"),
        (
            {
                "type": "object",
                "patternProperties": {"^a": STRINGS},
            },
            "/patternProperties/^a",
        ),
    ],
)
def test_what_the_tracker_cannot_follow_stays_refused(
    schema: Any, pointer: str, toy_tokenizer: Any
) -> None:
    with pytest.raises(SchemaNotEnforceableError) as caught:
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert ("uniqueItems", pointer) in {(i.keyword, i.pointer) for i in caught.value.issues}


def test_places_follow_keys_prefixes_and_refs() -> None:
    schema = {
        "type": "object",
        "properties": {
            "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#/$defs/s"}]},
            "plain": {"type": "array", "items": {"type": "string"}},
        },
        "additionalProperties": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/s"}]},
        "$defs": {"s": STRINGS},
    }
    places = unique_places(prepare_schema(schema).schema)
    assert places is not None
    keys = dict(places.keys[0])
    assert b"plain" in keys and keys[b"plain"] == -1  # no unique array below
    extra = places.key_default[0]
    assert extra >= 0 and places.unique[extra]
    pair = keys[b"pair"]
    assert not places.unique[pair] and places.prefix[pair][0] == -1
    assert places.unique[places.prefix[pair][1]] and places.item_default[pair] == -1


def test_a_mark_in_the_user_schema_is_dropped(toy_tokenizer: Any) -> None:
    schema = {"type": "array", "items": {"type": "string"}, MARK: True}
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert MARK not in compiled.spec.source
    assert grammar_accepts(compiled, toy_tokenizer, '["a", "a"]')


def test_a_structural_tags_schemas_keep_refusing_unique_items(toy_tokenizer: Any) -> None:
    """A structural tag's matcher is not wrapped by the tracker: its uniqueItems stay refused."""
    from espalier.constrained.structural_tag import structural_tag_spec

    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<t>",
            "content": {"type": "json_schema", "json_schema": STRINGS},
            "end": "</t>",
        },
    }
    with pytest.raises(SchemaNotEnforceableError) as caught:
        compile_grammar(structural_tag_spec(tag), toy_tokenizer)
    assert "uniqueItems" in {i.keyword for i in caught.value.issues}


@pytest.mark.parametrize(
    "items",
    [
        {"type": "string", "enum": ["pdf", "html", 3]},
        {"type": "integer", "enum": [1, "x", 2]},
        {"type": ["string", "null"], "const": "a"},
    ],
)
def test_typed_enum_items_are_listed_as_unique_arrays(items: Any, toy_tokenizer: Any) -> None:
    """A held-out sweep: ``{"type": "string", "enum": [...]}`` items were refused for
    ``uniqueItems`` while the same enum without ``type`` was listed (the type's members are
    kept, as the enum filter keeps them later)."""
    schema = {"type": "array", "items": items, "uniqueItems": True}
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert not report.weakened
    members = items.get("enum", [items.get("const")])
    pool = [*members, "zzz", 7, None]
    rng = random.Random(3)
    seen = {True: 0, False: 0}
    for _ in range(60):
        value = [rng.choice(pool) for _ in range(rng.randrange(4))]
        valid = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert grammar_accepts(compiled, toy_tokenizer, json.dumps(value)) == valid, value
        seen[valid] += 1
    assert seen[True] >= 5 and seen[False] >= 5, seen
