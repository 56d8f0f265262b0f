"""A grammar whose closing search costs too much is not closed (``START_BUDGET_S``).

A held-out sweep: llguidance's ``rfc.lark`` on xgrammar fills a mask in about 0.12 s past its
start (Gemma's vocabulary). The start path's search (greedy, backtracking, novel walk: bounded
in steps, not in time) then ran for minutes on a matcher thread; two such requests held both
matcher threads of a 2-core server and no new grammar got a matcher until a restart.
"""

from __future__ import annotations

from typing import Any

import pytest

import espalier.engine.closing as closing
from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import SamplingParams
from espalier.engine.closing import COSTLY, BudgetCloser, ClosingPaths
from espalier.engine.request import Request
from tests.fixtures.engine_fixtures import toy_tokenizer
from tests.fixtures.jsonschemabench import SHARED

RFC = SHARED / "grammars/lark/llguidance/rfc.lark"


@pytest.mark.skipif(not RFC.exists(), reason="../shared/conformance is not beside the checkout")
def test_a_start_path_search_past_its_budget_gives_up(gemma_tokenizer: Any) -> None:
    compiled, _ = compile_grammar(GrammarSpec.lark(RFC.read_text()), gemma_tokenizer, "xgrammar")
    paths = ClosingPaths(gemma_tokenizer)
    assert paths.start_path(compiled, compiled.matcher()) is COSTLY
    # kept per grammar: the next request of it does not search again
    assert paths.start_path(compiled, compiled.matcher()) is COSTLY


def test_a_costly_grammar_is_not_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the start path past its budget (here a budget of 0), the request's memo is
    unclosable: no check and no search, the output is left to max_tokens."""
    monkeypatch.setattr(closing, "START_BUDGET_S", -1.0)
    tokenizer = toy_tokenizer()
    spec = GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}})
    compiled, _ = compile_grammar(spec, tokenizer, "xgrammar")
    closer = BudgetCloser(tokenizer)
    request = Request("r", [1], SamplingParams(max_tokens=4), 0)
    request.matcher = compiled.matcher()
    request.compiled = compiled
    stops = set(tokenizer.stop_token_ids)
    for token in tokenizer.encode("[1, 2, 3, 4, 5")[:4]:
        assert closer.instead(request, token, stops, 10_000) is None
        assert request.matcher.accept(token)
        request.output_ids.append(token)
    assert closer.known("r") is None

    monkeypatch.setattr(closing, "START_BUDGET_S", 60.0)  # the same, closed in time
    closer = BudgetCloser(tokenizer)
    request = Request("r", [1], SamplingParams(max_tokens=4), 0)
    request.matcher = compiled.matcher()
    request.compiled = compiled
    closed = None
    for token in tokenizer.encode("[1, 2, 3, 4, 5")[:4]:
        closed = closer.instead(request, token, stops, 10_000)
        if closed is not None:
            break
        assert request.matcher.accept(token)
        request.output_ids.append(token)
    assert closed is not None
