"""One batch grammar call per step (``constrained/batch.py``): rows equal to one-by-one fills.

The Gemma vocabulary (262,144 ids, a multiple of 32) takes the libraries' batch entry points
(llguidance's ``LLExecutor``, xgrammar's ``BatchGrammarMatcher``); matchers at many states, a
terminated one, rows in any order, and a matcher that llguidance left in its error state (only
that row is reported, and it allows everything).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import get_backend
from espalier.constrained.backends.llguidance import MatcherStateError
from espalier.constrained.batch import BatchFiller
from espalier.constrained.spec import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["name", "tags"],
}
INSTANCE = json.dumps({"name": "espalier tree", "tags": [1, 22, 333]})


def _matchers(tokenizer: Any, backend: str) -> list[Any]:
    compiled = get_backend(backend, tokenizer).compile(GrammarSpec.json_schema(SCHEMA))
    tokens = tokenizer.encode(INSTANCE)
    matchers = []
    for cut in range(0, len(tokens) + 1, 2):
        matcher = compiled.matcher()
        assert matcher.accept_tokens(tokens[:cut]) == cut
        matchers.append(matcher)
    ended = compiled.matcher()
    assert ended.accept_tokens([*tokens, tokenizer.stop_token_ids[0]]) == len(tokens) + 1
    assert ended.is_terminated()
    return [*matchers, ended]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("threads", [1, 3])
def test_batch_rows_equal_one_by_one_fills(
    gemma_tokenizer: Any, backend: str, threads: int
) -> None:
    matchers = _matchers(gemma_tokenizer, backend)
    n = len(matchers)
    rows = list(torch.randperm(n + 3, generator=torch.Generator().manual_seed(1))[:n].tolist())
    expected = bm.allocate(n + 3, gemma_tokenizer.vocab_size, fill=0)
    for matcher, row in zip(matchers, rows):
        matcher.fill_bitmask(expected, row)
    got = bm.allocate(n + 3, gemma_tokenizer.vocab_size, fill=0x5EA)
    faults = BatchFiller(threads).fill_next_rows(matchers, got, rows)
    assert faults == {}
    assert torch.equal(got[rows], expected[rows])
    assert len({tuple(expected[r, :64].tolist()) for r in rows}) > 3  # the states do differ


def test_a_matcher_in_llguidance_error_state_is_its_own_fault(gemma_tokenizer: Any) -> None:
    good = _matchers(gemma_tokenizer, "llguidance")
    many = [f"option-{i:04d}" for i in range(2001)]
    bad = get_backend("llguidance", gemma_tokenizer).compile(GrammarSpec.choice(many)).matcher()
    with pytest.raises(MatcherStateError):
        bad.accept(gemma_tokenizer.encode("option")[0])
    matchers = [good[0], bad, *good[1:]]
    rows = list(range(len(matchers)))
    expected = bm.allocate(len(matchers), gemma_tokenizer.vocab_size, fill=0)
    for row, matcher in enumerate(good):
        matcher.fill_bitmask(expected, row if row == 0 else row + 1)
    got = bm.allocate(len(matchers), gemma_tokenizer.vocab_size, fill=0)
    faults = BatchFiller(2).fill_next_rows(matchers, got, rows)
    assert list(faults) == [1] and isinstance(faults[1], MatcherStateError)
    assert bool((got[1] == -1).all())  # the faulty request's row allows everything
    keep = [r for r in rows if r != 1]
    assert torch.equal(got[keep], expected[keep])
