"""Appending a step's tokens: the one-call run (``Engine._accept_run``) gives what appending them
one by one gives: the same output ids, text, finish reason and matcher state.

Each case appends the same token list to two identical requests of one engine: once as the engine
does it, once with the run turned off (``BudgetCloser.quiet_tokens`` answering 0, so every token
goes through the one-by-one loop).
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_fixtures import make_engine, toy_tokenizer

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import BACKENDS
from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import FinishReason, GenerationRequest, SamplingParams
from espalier.engine.detokenizer import IncrementalDetokenizer
from espalier.engine.request import Request
from espalier.engine.step import SeqOutcome

SCHEMA = GrammarSpec.json_schema(
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
)


def make_request(engine: Any, compiled: Any, name: str, max_tokens: int) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens)
    request = Request(name, [1, 2], sampling, 0, source=GenerationRequest(name, prompt="x"))
    request.detokenizer = IncrementalDetokenizer(engine._token_bytes, skip_ids=engine._skip_ids)
    request.matcher = compiled.matcher()
    return request


def append_both(engine: Any, compiled: Any, tokens: list[int], max_tokens: int) -> list[Any]:
    """(output ids, text, finish reason, error, next mask) for the run and the one-by-one path."""
    results = []
    for quiet in (None, 0):
        request = make_request(engine, compiled, f"r{quiet}", max_tokens)
        original = engine.closer.quiet_tokens
        if quiet is not None:
            engine.closer.quiet_tokens = lambda *_a, q=quiet: q
        try:
            out = engine._append(request, SeqOutcome(list(tokens)))
        finally:
            engine.closer.quiet_tokens = original
        row = bm.allocate(1, request.matcher.vocab_size, fill=0)
        request.matcher.fill_bitmask(row, 0)
        results.append(
            (list(request.output_ids), out.text_delta, out.finish_reason, out.error, row.tolist())
        )
        engine.closer.forget(request.request_id)
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_appends_as_one_by_one_does(backend: str) -> None:
    engine = make_engine()
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(SCHEMA, tokenizer, backend)
    stop = tokenizer.stop_token_ids[0]
    text = tokenizer.encode('{"a": "hello there"}')
    bad = tokenizer.encode("}")[0]  # rejected right after '{"a'
    cases = [
        (text[:6], 200),  # all valid, the request goes on
        ([*text, stop], 200),  # valid, then the stop token: STOP
        ([*text, stop], 5),  # the budget ends inside: LENGTH
        ([*text[:3], bad, *text[3:6]], 200),  # a rejected token inside the run: ERROR
        ([*text, *text[:2]], 200),  # the grammar is complete, then more text: rejected
    ]
    seen = set()
    for tokens, max_tokens in cases:
        fast, slow = append_both(engine, compiled, tokens, max_tokens)
        assert fast == slow, (tokens, max_tokens)
        seen.add(fast[2])
    assert {None, FinishReason.STOP, FinishReason.LENGTH, FinishReason.ERROR} <= seen
    engine.close()
