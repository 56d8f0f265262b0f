"""Stop strings and stop tokens under a constraint: the constraint decides where its text ends.

A held-out OpenAI sweep sent ``stop=[","]`` (and ``stop_token_ids``) with a strict JSON
schema: the output was cut mid-object, finish ``stop``, invalid. Under a constraint without
free text they are not applied; where a structural tag lets free text through (reasoning, text
around triggered tags) they still end the output there.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from espalier.constrained.spec import GrammarSpec
from espalier.constrained.structural_tag import after_reasoning
from espalier.engine.api import FinishReason, GenerationRequest, SamplingParams
from espalier.engine.spec.strategy import SpecConfig, install
from tests.fixtures.looping_model import looping_engine

LOOP = '"a", '
SCHEMA = {"type": "array", "items": {"type": "string"}, "maxItems": 3}


def _run(grammar: GrammarSpec | None, speculative: bool = False, **sampling: Any) -> Any:
    engine = looping_engine(LOOP)
    if speculative:
        install(engine, SpecConfig(methods=("forced",), num_draft_tokens=4), {})
    params = SamplingParams(max_tokens=40, **sampling)
    engine.add_request(GenerationRequest("r", prompt=LOOP, sampling=params, grammar=grammar))
    chunks = []
    while engine.has_unfinished():
        chunks += engine.step()
    tokens = [t for c in chunks for t in c.token_ids]
    return "".join(c.text_delta for c in chunks), chunks[-1], tokens


def test_a_stop_string_or_token_does_not_cut_a_json_output() -> None:
    comma = looping_engine(LOOP).tokenizer.encode(",")
    plain, _, _ = _run(None, stop=(",",))
    assert plain == '"a"'  # without a constraint the stop string applies
    for sampling in ({"stop": (",",)}, {"stop_token_ids": tuple(comma)}):
        text, last, tokens = _run(GrammarSpec.json_schema(SCHEMA), **sampling)
        assert last.finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR), sampling
        assert last.validation is not None and last.validation.valid, (sampling, text)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert "," in text
        spec_text, _, spec_tokens = _run(GrammarSpec.json_schema(SCHEMA), True, **sampling)
        assert spec_tokens == tokens and spec_text == text  # speculative == plain


def test_a_stop_string_still_ends_free_text_before_the_constraint() -> None:
    """Reasoning is free text: a stop there ends the output as without a constraint."""
    grammar = after_reasoning(GrammarSpec.json_schema(SCHEMA), "</think>")
    text, last, _ = _run(grammar, stop=(",",))
    assert text == '"a"' and last.finish_reason is FinishReason.STOP
    request = GenerationRequest("r", prompt="x", sampling=SamplingParams(stop=(",",)))
    assert request.sampling.stop == (",",)
    constrained = GenerationRequest(
        "r",
        prompt="x",
        sampling=SamplingParams(stop=(",",), stop_token_ids=(7,)),
        grammar=GrammarSpec.json_schema(SCHEMA),
    )
    assert constrained.sampling.stop == () and constrained.sampling.stop_token_ids == ()
