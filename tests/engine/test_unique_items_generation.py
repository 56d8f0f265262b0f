"""End to end: a model whose greedy output repeats an array item, under ``uniqueItems``.

The looping toy model (``tests/fixtures/looping_model.py``) writes ``"a", `` again and again.
Without ``uniqueItems`` the greedy output repeats ``"a"``; with it, the engine's matcher (the
backend's plus the tracker) removes the closing quote of a second ``"a"``, so the model writes
other items and the output is valid.
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


def _chunks(schema: dict[str, object], backend: str, speculative: bool = False) -> list[Any]:
    """The looping model's output chunks under ``schema`` (40 tokens at most)."""
    engine = looping_engine(LOOP)
    if speculative:
        install(engine, SpecConfig(methods=("forced",), num_draft_tokens=4), {})
    engine.add_request(
        GenerationRequest(
            "r",
            prompt=LOOP,
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


@pytest.mark.parametrize("speculative", [False, True])
def test_a_dead_end_says_why(speculative: bool) -> None:
    """With items of at most one character, ``"a`` can only end as ``"a"``, which the array
    already holds: the tracker refuses it one token late (a known limit), and the request's
    error says so instead of naming a token."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 1}, "uniqueItems": True}
    chunks = _chunks(schema, "llguidance", speculative)
    last = chunks[-1]
    assert last.finish_reason is FinishReason.ERROR
    assert last.error is not None and last.error.startswith("uniqueItems: every token"), last.error
    text = "".join(c.text_delta for c in chunks)
    assert text.replace(" ", "").startswith('["a","a'), text
    assert '"a","a"' not in text.replace(" ", "")  # never a duplicate accepted
