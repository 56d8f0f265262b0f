"""The budget closer's reuse of known closing paths (``engine/closing/``) stays sound.

Along random grammar-valid token sequences (budget 30, inside the closing window): every time
:meth:`BudgetCloser.instead` lets a token through, the path it keeps for the next check is
replayed on a fresh fork after the token and must complete the grammar within ``budget - 2``
tokens; a closing it returns must complete it within ``budget - 1``. The same tokens fed again
give the same answers (plain and speculative decoding close identically).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import SamplingParams
from espalier.engine.closing import BudgetCloser
from espalier.engine.request import Request
from tests.fixtures.engine_fixtures import CLOSING_SCHEMA, toy_tokenizer

SCHEMA = CLOSING_SCHEMA


def _run(tokenizer: Any, compiled: Any, seed: int, max_tokens: int, checks: list[int]) -> list[Any]:
    """Sample random allowed tokens through a closer; returns per token the closer's answer
    (``checks``: gets the output length of each kept path replayed)."""
    rng = random.Random(seed)
    closer = BudgetCloser(tokenizer)
    request = Request("r", [1], SamplingParams(max_tokens=max_tokens), 0)
    request.matcher = compiled.matcher()
    stops = set(tokenizer.stop_token_ids)
    row = bm.allocate(1, tokenizer.vocab_size, fill=0)
    answers: list[Any] = []
    while len(request.output_ids) < max_tokens and not request.matcher.is_terminated():
        request.matcher.fill_bitmask(row, 0)
        allowed = np.flatnonzero(bm.unpack_allowed(row[0], tokenizer.vocab_size)).tolist()
        allowed = [t for t in allowed if t not in stops] or allowed
        token = rng.choice(allowed)
        budget = max_tokens - len(request.output_ids)
        closing = closer.instead(request, token, stops, 10_000)
        answers.append((token, budget, closing))
        if closing is not None:
            probe = request.matcher.fork()
            assert all(probe.accept(t) for t in closing) and probe.can_terminate()
            assert len(closing) <= budget - 1
            break
        known = closer.known("r")
        probe = request.matcher.fork()
        assert probe.accept(token)
        # a path kept for the next length claims to close the state after token (older ones
        # are stale seeds for later tries: no claim)
        if known is not None and budget <= 64 and known[0] == len(request.output_ids) + 1:
            _, path = known
            assert len(path) <= budget - 2
            assert all(probe.accept(t) for t in path) and probe.can_terminate()
            checks.append(len(request.output_ids))
        request.output_ids.append(token)
        assert request.matcher.accept(token)
    return answers


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_reused_paths_are_sound_and_deterministic(backend: str) -> None:
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), tokenizer, backend)
    closed = 0
    checks: list[int] = []
    for seed in range(12):
        first = _run(tokenizer, compiled, seed, 30, checks)
        assert _run(tokenizer, compiled, seed, 30, []) == first
        closed += first[-1][2] is not None
    assert closed > 0  # random tokens do run out of budget
    assert checks  # and paths kept for the next token were replayed


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_first_token_on_the_start_states_path_is_let_through_at_once(backend: str) -> None:
    """Before its first token a request's memo holds its grammar's start-state closing path,
    searched once per compiled grammar: a first token that begins it needs no grammar work,
    and the rest of it closes the state after that token."""
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), tokenizer, backend)
    closer = BudgetCloser(tokenizer)
    stops = set(tokenizer.stop_token_ids)
    kept = []
    for name in ("a", "b"):
        request = Request(name, [1], SamplingParams(max_tokens=40), 0)
        request.compiled, request.matcher = compiled, compiled.matcher()
        start = closer.paths.find(request.matcher, 64)  # type: ignore[union-attr]
        assert start is not None
        assert closer.instead(request, start[0], stops, 10_000) is None
        known = closer.known(name)
        assert known is not None and known[0] == 1 and known[1] == start[1:]
        assert request.matcher.accept(start[0])
        probe = request.matcher.fork()
        assert probe.accept_tokens(known[1]) == len(known[1]) and probe.can_terminate()
        kept.append(known[1])
    assert kept[0] == kept[1]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_first_token_is_decided_once_per_grammar_token_and_budget(backend: str) -> None:
    """A request's first decision is a function of its grammar, first token, budget and
    exempt: requests sharing them take the first one's decision (one search per key, not one
    per request), and it equals the decision a closer that never met the grammar makes."""
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), tokenizer, backend)
    stops = set(tokenizer.stop_token_ids)
    row = bm.allocate(1, tokenizer.vocab_size, fill=0)
    start = compiled.matcher()
    start.fill_bitmask(row, 0)
    allowed = np.flatnonzero(bm.unpack_allowed(row[0], tokenizer.vocab_size)).tolist()
    firsts = [t for t in allowed if t not in stops][:6]
    assert len(firsts) >= 2
    closer = BudgetCloser(tokenizer)
    made: list[int] = []
    decide = closer.decide

    def counted(*args: Any) -> Any:
        made.append(args[2])  # the token
        return decide(*args)

    closer.decide = counted  # type: ignore[method-assign]

    def first(
        on: BudgetCloser, name: str, token: int, max_tokens: int, ignore_eos: bool = False
    ) -> tuple[Any, Any]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        request = Request(name, [1], params, 0)
        request.compiled, request.matcher = compiled, compiled.matcher()
        return on.instead(request, token, stops, 10_000), on.known(name)

    for max_tokens in (6, 40):
        for token in firsts:
            fresh = first(BudgetCloser(tokenizer), "f", token, max_tokens)
            before = len(made)
            for name in ("a", "b", "c"):
                assert first(closer, f"{name}{token}-{max_tokens}", token, max_tokens) == fresh
            assert len(made) - before <= 1  # the first request's decision, then the kept one
    # ignore_eos requests (no start path in their memo) decide each time
    before = len(made)
    for name in ("x", "y"):
        first(closer, name, firsts[0], 40, ignore_eos=True)
    assert len(made) - before == 2


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_batch_makes_each_first_decision_once(backend: str) -> None:
    """``prepare`` for a burst's first tokens makes one decision per (grammar, token, budget,
    exempt) and hands it to every request of the batch that shares the key; each request's
    ``instead`` then equals a fresh closer's, with no decision of its own."""
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), tokenizer, backend)
    stops = set(tokenizer.stop_token_ids)
    row = bm.allocate(1, tokenizer.vocab_size, fill=0)
    compiled.matcher().fill_bitmask(row, 0)
    allowed = np.flatnonzero(bm.unpack_allowed(row[0], tokenizer.vocab_size)).tolist()
    firsts = [t for t in allowed if t not in stops][:3]
    assert len(firsts) >= 2

    def request(name: str, max_tokens: int) -> Request:
        made = Request(name, [1], SamplingParams(max_tokens=max_tokens), 0)
        made.compiled, made.matcher = compiled, compiled.matcher()
        return made

    closer = BudgetCloser(tokenizer)
    made: list[tuple[int, int]] = []
    decision = closer.decision

    def counted(*args: Any) -> Any:
        made.append((args[2], args[4]))  # the token, the budget
        return decision(*args)

    closer.decision = counted  # type: ignore[method-assign]
    batch = [
        (request(f"r{k}-{token}-{budget}", budget), token, 0, stops)
        for budget in (6, 40)
        for token in firsts
        for k in range(3)
    ]
    closer.prepare(batch, 10_000)
    # one decision per key that needs one (three requests share each), not one per request
    assert made and len(made) == len(set(made))
    prepared = list(made)
    for item, token, _here, _stops in batch:
        fresh = BudgetCloser(tokenizer)
        twin = request(item.request_id, item.sampling.max_tokens)
        expected = fresh.instead(twin, token, stops, 10_000), fresh.known(twin.request_id)
        got = closer.instead(item, token, stops, 10_000), closer.known(item.request_id)
        assert got == expected, item.request_id
    # only the keys ``prepare`` left alone (no grammar work: the kept path's own first token)
    assert not set(made[len(prepared) :]) & set(prepared)
