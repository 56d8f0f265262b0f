"""End to end: a model whose greedy output repeats an array item, under ``uniqueItems``.

The looping toy model (``tests/fixtures/looping_model.py``) writes ``"a", `` again and again.
Without ``uniqueItems`` the greedy output repeats ``"a"``; with it, the engine's matcher (the
backend's plus the tracker) removes the closing quote of a second ``"a"``, so the model writes
other items and the output is valid. Where every way on repeats an item or a key (a dead end),
the duplicate is refused all the same: the closing policy closes the output before it, or the
request ends with an error that says why.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import ConstraintOptions, FinishReason, GenerationRequest, SamplingParams
from espalier.engine.spec.strategy import SpecConfig, install
from tests.fixtures.looping_model import looping_engine

LOOP = '"a", '


def _chunks(
    schema: dict[str, object],
    backend: str,
    speculative: bool = False,
    *,
    loop: str = LOOP,
    close: bool = True,
) -> list[Any]:
    """The looping model's output chunks under ``schema`` (40 tokens at most); ``close``: the
    closing policy (``EngineConfig.close_within_budget``)."""
    engine = looping_engine(loop, close_within_budget=close)
    if speculative:
        install(engine, SpecConfig(methods=("forced",), num_draft_tokens=4), {})
    engine.add_request(
        GenerationRequest(
            "r",
            prompt=loop,
            sampling=SamplingParams(max_tokens=40),
            grammar=GrammarSpec.json_schema(schema),
            constraint=ConstraintOptions(backend=backend),
        )
    )
    chunks = []
    while engine.has_unfinished():
        chunks += engine.step()
    return chunks


def _generate(schema: dict[str, object], backend: str) -> str:
    chunks = _chunks(schema, backend)
    last = chunks[-1]
    assert last.finished and last.validation is not None and last.validation.valid
    return "".join(c.text_delta for c in chunks)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_the_greedy_repeat_is_refused(backend: str) -> None:
    plain = {"type": "array", "items": {"type": "string"}, "maxItems": 5}
    loose = json.loads(_generate(plain, backend))
    assert loose.count("a") >= 2  # the model does repeat its item

    unique = {**plain, "uniqueItems": True}
    text = _generate(unique, backend)
    value = json.loads(text)
    jsonschema.validate(value, unique)
    assert len(value) >= 2 and value[0] == "a", text


DEAD_ENDS = [  # (looped text, schema): where the item or key so far can only end as a duplicate
    # the item "a" can only end, though the pattern's strings are unbounded ("bb...")
    (
        LOOP,
        {"type": "array", "items": {"type": "string", "pattern": "^(a|b+)$"}, "uniqueItems": True},
    ),
    ('"a": 1, ', {"type": "object", "propertyNames": {"maxLength": 1}}),
]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize(("loop", "schema"), DEAD_ENDS)
def test_a_dead_end_says_why(speculative: bool, loop: str, schema: dict[str, object]) -> None:
    """Items of ``^(a|b+)$`` or keys of at most one character: ``"a`` can only end as ``"a"``,
    which the array or object already holds. Without the closing policy the tracker refuses
    it one token late (a known limit), and the request's error says so instead of naming a
    token."""
    chunks = _chunks(schema, "llguidance", speculative, loop=loop, close=False)
    last = chunks[-1]
    text = "".join(c.text_delta for c in chunks).replace(" ", "")
    assert last.finish_reason is FinishReason.ERROR, text
    why = "uniqueItems: every token" if schema["type"] == "array" else "duplicate key: every token"
    assert last.error is not None and last.error.startswith(why), last.error
    first = loop.replace(" ", "")
    assert text[0] == ("[" if schema["type"] == "array" else "{"), text
    assert text[1:].startswith(first + '"a'), text
    assert first + '"a"' not in text  # never a duplicate accepted


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize(("loop", "schema"), DEAD_ENDS)
def test_the_closing_policy_steers_past_a_dead_end(
    speculative: bool, loop: str, schema: dict[str, object]
) -> None:
    """With the closing policy (the default), the check before each token finds no way to
    close after the ``a`` that leads into the dead end, so the request closes there instead:
    a valid output, no duplicate."""
    chunks = _chunks(schema, "llguidance", speculative, loop=loop)
    last = chunks[-1]
    text = "".join(c.text_delta for c in chunks)
    assert last.finish_reason is FinishReason.STOP and last.closed_by_budget, text
    assert last.validation is not None and last.validation.valid, text
    jsonschema.validate(json.loads(text), schema)


FINITE_NAMES = {"type": "object", "propertyNames": {"pattern": "^[a-c]$"},
                "additionalProperties": {"type": "boolean"}, "minProperties": 1}  # fmt: skip


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("backend", ["llguidance", "auto"])
def test_names_from_a_finite_pattern_are_never_a_dead_end(speculative: bool, backend: str) -> None:
    """A held-out sweep: under ``propertyNames: {pattern: "^[a-c]$"}`` a model that repeats its
    keys wrote ``"a"`` and ``"b"``, then ``"b`` (only a duplicate could follow) and the request
    failed (500 through the OpenAI API at temperature 0). The names are now declared properties
    (``pattern_properties.finite_names``), which no backend repeats: the output is valid, with
    or without the closing policy."""
    for close in (False, True):
        chunks = _chunks(FINITE_NAMES, backend, speculative, loop='"b": true, ', close=close)
        last = chunks[-1]
        text = "".join(c.text_delta for c in chunks)
        assert last.finish_reason is not FinishReason.ERROR, (last.error, text)
        value = json.loads(text)
        jsonschema.validate(value, FINITE_NAMES)
        assert value.get("b") is True, text


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("close", [False, True])
def test_an_item_at_its_longest_is_refused_before_the_dead_end(
    speculative: bool, close: bool
) -> None:
    """Items of at most one character (a held-out sweep: ``maxLength: 2`` with ``minItems:
    300`` failed the request): the ``a`` that would leave a second ``"a`` at its longest, with
    only a duplicate's quote to follow, is refused, so the model writes other items. Without the
    closing policy too, no error: the output is cut at max_tokens or valid."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 1}, "uniqueItems": True}
    chunks = _chunks(schema, "llguidance", speculative, close=close)
    last = chunks[-1]
    text = "".join(c.text_delta for c in chunks)
    assert last.finish_reason is not FinishReason.ERROR, (text, last.error)
    items = json.loads(text.rstrip(", ") + ("" if text.rstrip().endswith("]") else "]"))
    assert len(items) >= 3 and items[0] == "a" and len(set(items)) == len(items), text
