"""A constraint that spells a special token's text (``<eot>`` in the toy vocabulary, Gemma's
``<start_of_turn>``) is written in ordinary tokens.

The matchers never take a special non-stop token. llguidance tokenizes the literals it forces
through our tokenizer; that used to parse the spelling into the special token, so the mask
allowed only that token, the sampler took it, ``accept`` refused it and the request ended
``ERROR`` ("the grammar rejected sampled token 2"). Grammar text is now tokenized as plain text
(``TokenizerInfo.encode_text``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.token_bytes import special_token_ids
from espalier.engine.api import ConstraintOptions, FinishReason, GenerationRequest, SamplingParams
from espalier.engine.spec.strategy import SpecConfig, install
from tests.fixtures.engine_fixtures import make_engine, run_all, text_of

SPECS = [
    (GrammarSpec.regex("<eot>x"), "<eot>x"),
    (GrammarSpec.json_schema({"const": "<eot>"}), '"<eot>"'),
    (GrammarSpec.lark('start: "<pad>" "y"'), "<pad>y"),
]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar"])
def test_a_special_tokens_spelling_is_generated_as_text(backend: str, speculative: bool) -> None:
    engine = make_engine()
    if speculative:
        install(engine, SpecConfig(methods=("forced",), num_draft_tokens=4), {})
    requests = [
        GenerationRequest(
            f"r{i}",
            prompt="Write:",
            sampling=SamplingParams(max_tokens=16),
            grammar=spec,
            constraint=ConstraintOptions(backend=backend),
        )
        for i, (spec, _) in enumerate(SPECS)
    ]
    out = run_all(engine, requests)
    specials = special_token_ids(engine.tokenizer.hf) - set(engine.tokenizer.stop_token_ids)
    for i, (_, text) in enumerate(SPECS):
        chunks = out[f"r{i}"]
        last = chunks[-1]
        assert last.finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR), last
        assert text_of(chunks) == text
        assert last.validation is not None and last.validation.valid
        assert not specials & {t for c in chunks for t in c.token_ids}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (GrammarSpec.regex("<start_of_turn>"), "<start_of_turn>"),
        # a stop token's spelling: text too, not the stop token
        (GrammarSpec.regex("<eos>"), "<eos>"),
        (GrammarSpec.regex("<bos>x"), "<bos>x"),
        (GrammarSpec.json_schema({"const": "<start_of_turn>"}), '"<start_of_turn>"'),
        (GrammarSpec.lark('start: "<end_of_turn>" "!"'), "<end_of_turn>!"),
    ],
)
def test_no_row_of_a_special_spelling_allows_a_special_token(
    backend: str, spec: GrammarSpec, text: str, gemma_tokenizer: Any
) -> None:
    """Along the text's plain-text tokens, no row allows a special token other than a stop
    token once complete, forced tokens hold none, and the text is accepted."""
    compiled, _ = compile_grammar(spec, gemma_tokenizer, backend)
    specials = special_token_ids(gemma_tokenizer.hf) - set(gemma_tokenizer.stop_token_ids)
    matcher = compiled.matcher()
    assert not specials & set(matcher.forced_tokens(32))
    row = bm.allocate(1, gemma_tokenizer.vocab_size, fill=0)
    for token in gemma_tokenizer.encode_text(text):
        matcher.fill_bitmask(row, 0)
        allowed = set(np.flatnonzero(bm.unpack_allowed(row[0], gemma_tokenizer.vocab_size)))
        assert allowed and not specials & allowed
        assert matcher.accept(token)
    assert matcher.can_terminate()
    assert grammar_accepts(compiled, gemma_tokenizer, text)
