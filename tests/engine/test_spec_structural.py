"""Speculation stays lossless across structural-tag and reasoning switches: speculative output ==
plain constrained greedy output, token for token, where the output crosses from free text into
a tag (or past the reasoning end marker) and back.

The random model emits no tag on its own, so each trigger and marker is a piece of text its own
greedy output contains; the test checks that the switch did happen.
"""

from __future__ import annotations

from typing import Any

import pytest

from espalier.constrained.backends import get_backend
from espalier.constrained.backends.common import BackendOptions
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.structural_tag import after_reasoning, structural_tag_spec
from espalier.engine.spec.combine import Proposer
from espalier.engine.spec.decoder import SpeculativeDecoder
from espalier.engine.spec.masks import MaskBuilder
from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
from tests.fixtures.spec_helpers import SCHEMA, plain_greedy, random_runner, tiny_config
from tests.fixtures.spec_loop import LoopRequest, SpecLoop

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def runner(toy_tokenizer: Any) -> Any:
    return random_runner(tiny_config(toy_tokenizer.vocab_size), seed=0)


def tool_tag(trigger: str) -> GrammarSpec:
    tag = {
        "type": "tag",
        "begin": trigger,
        "content": {"type": "json_schema", "json_schema": SCHEMA},
        "end": "\n",
    }
    fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": [tag]}
    return structural_tag_spec({"type": "structural_tag", "format": fmt})


def reasoning(marker: str) -> GrammarSpec:
    return after_reasoning(GrammarSpec.json_schema(SCHEMA), marker)


def matcher_for(tokenizer: Any, backend: str, spec: GrammarSpec) -> Any:
    options = BackendOptions(json_max_whitespace=1, xgrammar_memory_limit=0)
    return get_backend(backend, tokenizer, options).compile(spec).matcher()


def switching_spec(runner: Any, tokenizer: Any, backend: str, build: Any) -> GrammarSpec:
    """``build(piece)`` for a two-character ``piece`` of the free text this backend lets the
    model write (its first occurrence ending on a token boundary, after a few tokens), under
    which the plain constrained output contains ``piece``: the switch happens."""
    stops = frozenset(tokenizer.stop_token_ids)
    never = build("\x7f\x7f")  # a trigger / marker the model does not write: free text only
    free = plain_greedy(
        runner, PROMPT, 16, matcher=matcher_for(tokenizer, backend, never), stop_ids=stops
    )
    for end in range(3, len(free)):
        text = tokenizer.decode(free[:end])
        piece = text[-2:]
        if not piece.isprintable() or not piece.strip() or piece in text[:-1]:
            continue
        spec = build(piece)
        matcher = matcher_for(tokenizer, backend, spec)
        out = plain_greedy(runner, PROMPT, MAX_TOKENS, matcher=matcher, stop_ids=stops)
        if piece in tokenizer.decode(out):
            return spec
    pytest.fail(f"no piece of {tokenizer.decode(free)!r} makes the constrained output switch")


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("build", [tool_tag, reasoning], ids=["tool_tag", "reasoning"])
def test_speculative_equals_plain_across_the_switch(
    runner: Any, toy_tokenizer: Any, backend: str, build: Any
) -> None:
    spec = switching_spec(runner, toy_tokenizer, backend, build)
    stops = frozenset(toy_tokenizer.stop_token_ids)
    proposer = Proposer({"ngram": NgramDrafter(NgramConfig(min_n=1, max_n=3))})
    loop = SpecLoop(SpeculativeDecoder(runner, proposer, MaskBuilder(runner.vocab_size)))
    matcher = matcher_for(toy_tokenizer, backend, spec)
    methods = ("ngram", "forced")
    results = loop.generate([LoopRequest("r", PROMPT, MAX_TOKENS, matcher, methods, 6, stops)])
    expected = plain_greedy(
        runner,
        PROMPT,
        MAX_TOKENS,
        matcher=matcher_for(toy_tokenizer, backend, spec),
        stop_ids=stops,
    )
    for result in results:
        assert result.output_ids == expected
    assert any(result.stats.draft_tokens for result in results)
