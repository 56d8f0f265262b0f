"""Every constrained output max_tokens reaches is valid, or says it is not (issue 36 item 3).

A model that loops on ``{"task": `` (``tests/fixtures/looping_model.py``) in a recursive
schema never ends by itself: with the closing policy its output closes valid within the budget;
where no valid output fits the budget, or the policy is off, it ends with
``FinishReason.LENGTH_UNCLOSED``. Outputs that may end where the budget cut them (unconstrained,
or a grammar that can terminate there) keep ``LENGTH``.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import (
    ConstraintOptions,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    SamplingParams,
)
from espalier.engine.engine import Engine
from tests.fixtures.looping_model import looping_engine, toy_tokenizer

LOOP = '{"task": '
RECURSIVE = {"type": "object", "properties": {"task": {"$ref": "#"}}}
# the shortest valid output is ``{"a_long_required_name":""}``: over 20 toy tokens
LONG_REQUIRED = {
    "type": "object",
    "properties": {"task": {"$ref": "#"}, "a_long_required_name": {"type": "string"}},
    "required": ["a_long_required_name"],
}
BACKEND = "llguidance"  # the recursive schemas' exact backend that compiles fast on the toy model


def finish(
    engine: Engine, grammar: GrammarSpec | None, max_tokens: int
) -> tuple[RequestOutput, str]:
    """Run one request prompted with the loop; its final chunk and whole text."""
    engine.add_request(
        GenerationRequest(
            "r",
            prompt=LOOP,
            sampling=SamplingParams(max_tokens=max_tokens),
            grammar=grammar,
            constraint=ConstraintOptions(backend=BACKEND),
        )
    )
    chunks: list[RequestOutput] = []
    while engine.has_unfinished():
        chunks += engine.step()
    assert chunks and chunks[-1].finished and chunks[-1].usage is not None
    return chunks[-1], "".join(c.text_delta for c in chunks)


@pytest.mark.parametrize("max_tokens", [2, 3, 5, 12, 40, 90])
def test_a_looping_recursive_output_closes_or_says_unclosed(max_tokens: int) -> None:
    """Valid and closed by the policy, or LENGTH_UNCLOSED; never a plain LENGTH cut. The
    policy's greedy search needs 7 tokens from the start (``{"":""}``: it tries ``"`` before
    ``}``), so the smallest budgets end open; from 12 tokens on it must close."""
    last, text = finish(looping_engine(LOOP), GrammarSpec.json_schema(RECURSIVE), max_tokens)
    assert last.usage is not None and last.usage.completion_tokens <= max_tokens
    assert last.validation is not None
    if last.finish_reason is FinishReason.LENGTH_UNCLOSED:
        assert max_tokens < 12 and not last.validation.valid, text
        assert last.usage.completion_tokens == max_tokens and not last.closed_by_budget
        return
    assert last.finish_reason is FinishReason.STOP and last.closed_by_budget, (last, text)
    assert last.validation.valid, text
    jsonschema.validate(json.loads(text), RECURSIVE)
    if max_tokens >= 40:  # the model did loop before the policy closed it
        assert text.startswith(LOOP * 3), text


@pytest.mark.parametrize("max_tokens", [12, 40])
def test_a_looping_output_the_policy_leaves_open_says_so(max_tokens: int) -> None:
    last, text = finish(
        looping_engine(LOOP, close_within_budget=False),
        GrammarSpec.json_schema(RECURSIVE),
        max_tokens,
    )
    assert last.finish_reason is FinishReason.LENGTH_UNCLOSED, (last, text)
    assert last.usage is not None and last.usage.completion_tokens == max_tokens
    assert text.startswith(LOOP) and not last.closed_by_budget
    assert last.validation is not None and not last.validation.valid
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@pytest.mark.parametrize("close_within_budget", [True, False])
def test_no_valid_output_fits_the_budget(close_within_budget: bool) -> None:
    engine = looping_engine(LOOP, close_within_budget=close_within_budget)
    last, text = finish(engine, GrammarSpec.json_schema(LONG_REQUIRED), 8)
    assert last.finish_reason is FinishReason.LENGTH_UNCLOSED, (last, text)
    assert last.usage is not None and last.usage.completion_tokens == 8
    assert last.validation is not None and not last.validation.valid


def test_unconstrained_outputs_keep_length() -> None:
    last, text = finish(looping_engine(LOOP), None, 10)
    assert last.finish_reason is FinishReason.LENGTH and text.startswith(LOOP)
    assert last.usage is not None and last.usage.completion_tokens == 10


def test_a_grammar_that_may_end_at_the_cut_keeps_length() -> None:
    """A repetition of the loop's text, the policy off: the cut after whole repetitions is a
    valid end (LENGTH), one token further it is not (LENGTH_UNCLOSED)."""
    cycle = len(toy_tokenizer().encode(LOOP))
    grammar = GrammarSpec.regex(r'(\{"task": )*')
    engine = looping_engine(LOOP, close_within_budget=False)
    last, text = finish(engine, grammar, 2 * cycle)
    assert last.finish_reason is FinishReason.LENGTH and text == LOOP * 2, (last, text)
    assert last.validation is not None and last.validation.valid
    last, text = finish(engine, grammar, 2 * cycle + 1)
    assert last.finish_reason is FinishReason.LENGTH_UNCLOSED and text == LOOP * 2 + '{"'
    assert last.validation is not None and not last.validation.valid


@pytest.mark.parametrize("max_tokens", [6, 14, 15])
def test_with_the_policy_every_output_is_valid_or_unclosed(max_tokens: int) -> None:
    engine = looping_engine(LOOP)
    last, text = finish(engine, GrammarSpec.regex(r'(\{"task": )*'), max_tokens)
    assert last.validation is not None
    if last.finish_reason is FinishReason.LENGTH_UNCLOSED:
        assert not last.validation.valid, text
    else:
        assert last.validation.valid and text == LOOP * (len(text) // len(LOOP)), (last, text)
