"""``GrammarMatcher.completes`` (closing-path checks without consuming) against its definition.

From random grammar-valid prefixes, runs that complete the grammar (closing paths), valid runs
that do not, runs with a random token inside (mostly rejected) and runs through a stop token, for
every backend and with the duplicate-key tracker: ``completes`` equals a fork accepting the run
then ``can_terminate``, and the matcher's own next row and ``can_terminate`` stay as they were.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import BACKENDS
from espalier.constrained.compile import compile_grammar
from espalier.constrained.keys.matcher import with_unique_keys
from espalier.constrained.spec import GrammarSpec
from espalier.engine.closing import ClosingPaths
from tests.fixtures.engine_fixtures import toy_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "integer"}},
        "meta": {"type": "object"},
    },
    "required": ["name"],
}


def _allowed(matcher: Any, row: torch.Tensor, vocab: int) -> list[int]:
    matcher.fill_bitmask(row, 0)
    return np.flatnonzero(bm.unpack_allowed(row[0], vocab)).tolist()


def _expected(matcher: Any, run: list[int]) -> bool:
    probe = matcher.fork()
    return probe.accept_tokens(run) == len(run) and probe.can_terminate()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("unique_keys", [False, True])
def test_completes_equals_accepting_on_a_fork(backend: str, unique_keys: bool) -> None:
    tokenizer = toy_tokenizer()
    spec = GrammarSpec.json_schema(SCHEMA)
    compiled, _ = compile_grammar(spec, tokenizer, backend)
    vocab = tokenizer.vocab_size
    stop = tokenizer.stop_token_ids[0]
    paths = ClosingPaths(tokenizer)
    row = bm.allocate(1, vocab, fill=0)
    rng = random.Random(7)
    outcomes: list[bool] = []
    for _ in range(12):
        matcher = compiled.matcher()
        if unique_keys:
            matcher = with_unique_keys(spec, matcher, tokenizer)
        for _ in range(rng.randrange(0, 14)):
            choices = [t for t in _allowed(matcher, row, vocab) if t != stop]
            if not choices:
                break
            assert matcher.accept(rng.choice(choices))
        closing = paths.find(matcher, 40) or []
        walk, probe = [], matcher.fork()
        for _ in range(rng.randrange(1, 6)):
            choices = [t for t in _allowed(probe, row, vocab) if t != stop]
            if not choices:
                break
            walk.append(rng.choice(choices))
            assert probe.accept(walk[-1])
        runs = [closing, closing[:-1], walk, [*walk, stop], [*closing, stop]]
        runs.append([*walk[:1], rng.randrange(vocab), *walk[1:]])
        before = _allowed(matcher, row, vocab), matcher.can_terminate()
        for run in runs:
            got = matcher.completes(run)
            assert got == _expected(matcher, run), run
            outcomes.append(got)
        assert (_allowed(matcher, row, vocab), matcher.can_terminate()) == before
    assert True in outcomes and False in outcomes
