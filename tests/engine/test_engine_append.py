"""Appending a step's tokens: the one-call run (``Engine._accept_runs``) gives what appending them
one by one gives: the same output ids, text tokens, finish reason and matcher state.

Each case appends the same token list to two identical requests of one engine: once as the engine
does it, once with the run turned off (``BudgetCloser.pass_through`` answering 0, so every token
goes through the one-by-one loop). Inside the closing window the closer's memo must end the same
too (later checks depend on it).
"""

from __future__ import annotations

from typing import Any

import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import BACKENDS
from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import FinishReason, GenerationRequest, SamplingParams
from espalier.engine.request import Request
from espalier.engine.step import SeqOutcome
from tests.fixtures.engine_fixtures import make_engine, toy_tokenizer

SCHEMA = GrammarSpec.json_schema(
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
)


def make_request(engine: Any, compiled: Any, name: str, max_tokens: int) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens)
    request = Request(name, [1, 2], sampling, 0, source=GenerationRequest(name, prompt="x"))
    request.matcher = compiled.matcher()
    return request


def append_both(engine: Any, compiled: Any, steps: list[list[int]], max_tokens: int) -> list[Any]:
    """Per path (the run, then one by one), after appending each step's tokens: output ids,
    the chunk's tokens and how many make text, finish reason, error, next mask, and the
    closer's memo."""
    results = []
    for one_by_one in (False, True):
        request = make_request(engine, compiled, f"r{one_by_one}", max_tokens)
        original = engine.closer.pass_through
        if one_by_one:
            engine.closer.pass_through = lambda *_a: 0
        seen = []
        try:
            for tokens in steps:
                chunks: list[Any] = []  # the step's path: runs, closing, batch accepts
                engine._append_all({0: (request, SeqOutcome(list(tokens)))}, chunks)
                (out,) = chunks
                row = bm.allocate(1, request.matcher.vocab_size, fill=0)
                request.matcher.fill_bitmask(row, 0)
                memo = engine.closer._memo.get(request.request_id)
                seen.append(
                    (
                        list(request.output_ids),
                        (out.token_ids, out.text_tokens),
                        out.finish_reason,
                        out.error,
                        row.tolist(),
                        memo,
                    )
                )
                if out.finished:
                    break
        finally:
            engine.closer.pass_through = original
        results.append(seen)
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
    long = tokenizer.encode('{"a": "' + "lorem ipsum dolor sit amet " * 3)
    done = [tokenizer.encode('"')[0], tokenizer.encode("}")[0], stop]
    cases = [
        ([text[:6]], 200),  # all valid, the request goes on
        ([[*text, stop]], 200),  # valid, then the stop token: STOP
        ([[*text, stop]], 5),  # the budget ends where the grammar cannot: LENGTH_UNCLOSED
        ([[*text[:3], bad, *text[3:6]]], 200),  # a rejected token inside the run: ERROR
        ([[*text, *text[:2]]], 200),  # the grammar is complete, then more text: rejected
        # inside the closing window: steps of 5 tokens, checks due now and then, a closing
        ([long[i : i + 5] for i in range(0, len(long), 5)], 40),
        ([long[i : i + 5] for i in range(0, len(long), 5)], len(long) + 8),
        # ... ending on the closing path the closer keeps (its memo moves along it)
        ([*[long[i : i + 5] for i in range(0, len(long), 5)], done], len(long) + 12),
    ]
    seen = set()
    for steps, max_tokens in cases:
        fast, slow = append_both(engine, compiled, steps, max_tokens)
        assert fast == slow, (steps, max_tokens)
        seen.update(step[2] for step in fast)
    assert {None, FinishReason.STOP, FinishReason.LENGTH_UNCLOSED, FinishReason.ERROR} <= seen
    engine.close()


def test_pass_through_moves_the_memo_as_instead_does() -> None:
    """Tokens that follow the kept closing path advance it; the run and one-by-one ``instead``
    calls leave the same memo, and both stop for a token that needs a check."""
    from espalier.engine.closing import BudgetCloser, Memo

    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(SCHEMA, tokenizer, "llguidance")
    prefix = tokenizer.encode('{"a": "xy')
    quote, brace = tokenizer.encode('"')[0], tokenizer.encode("}")[0]
    stops = set(tokenizer.stop_token_ids)
    memos = []
    for one_by_one in (False, True):
        closer = BudgetCloser(tokenizer)
        request = Request("r", [1], SamplingParams(max_tokens=len(prefix) + 20), 0)
        request.matcher = compiled.matcher()
        for token in prefix:
            assert request.matcher.accept(token)
            request.output_ids.append(token)
        here = len(prefix)
        closer._memo["r"] = Memo((here, [quote, brace]), next_check=here + 1)
        if one_by_one:
            for token in (quote, brace):
                assert closer.instead(request, token, stops, 10_000) is None
                request.output_ids.append(token)
                assert request.matcher.accept(token)
        else:
            assert closer.pass_through(request, [quote, brace], 10_000) == 2
        memos.append(closer._memo["r"])
        # a token off the path at a due check needs grammar work: the run stops before it
        stale = Memo((here, [quote, brace]), next_check=here)
        closer._memo["r"] = stale
        request.output_ids[here:] = []
        assert closer.pass_through(request, [tokenizer.encode("z")[0]], 10_000) == 0
        assert closer._memo["r"] == stale
    assert memos[0] == memos[1] == Memo((len(prefix) + 2, []), next_check=len(prefix) + 1)
