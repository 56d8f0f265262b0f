"""Closing decisions made ahead along a draft tree (``engine/closing/ahead.py``) are exactly the
inline ones.

Two closers see the same grammar-valid random token streams (budget 30: inside the closing
window). Before each "step" the first gets a random draft tree below the current state
(branches of random allowed tokens, one branch continuing the stream) and runs its lookahead
job; then both are fed the step's tokens (the stream's, which leave the tree at a random point,
like a bonus token). Every answer and the kept memo must be the same, and the lookahead must
have answered most tokens.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.compile import compile_grammar
from espalier.constrained.errors import SchemaNotEnforceableError
from espalier.constrained.spec import GrammarSpec
from espalier.engine import closing
from espalier.engine.api import SamplingParams
from espalier.engine.closing import FALLBACK_RUNS, NO_MEMO, BudgetCloser
from espalier.engine.closing import ahead as closing_ahead
from espalier.engine.request import Request
from tests.fixtures.engine_fixtures import CLOSING_SCHEMA, toy_tokenizer

SCHEMA = CLOSING_SCHEMA


def _allowed(matcher: Any, tokenizer: Any, row: Any, stops: set[int]) -> list[int]:
    matcher.fill_bitmask(row, 0)
    allowed = np.flatnonzero(bm.unpack_allowed(row[0], tokenizer.vocab_size)).tolist()
    return [t for t in allowed if t not in stops] or allowed


def _stream(tokenizer: Any, compiled: Any, rng: random.Random, n: int) -> list[int]:
    """A grammar-valid token sequence (random allowed tokens, often repeating the last one)."""
    matcher = compiled.matcher()
    row = bm.allocate(1, tokenizer.vocab_size, fill=0)
    stops = set(tokenizer.stop_token_ids)
    out: list[int] = []
    while len(out) < n and not matcher.is_terminated():
        allowed = _allowed(matcher, tokenizer, row, stops)
        repeat = out and out[-1] in allowed and rng.random() < 0.5
        token = out[-1] if repeat else rng.choice(allowed)
        assert matcher.accept(token)
        out.append(token)
    return out


def _tree(stream: list[int], root: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A draft tree whose first branch follows ``stream`` for a while, plus random side nodes
    (tokens from the stream's later positions: valid or not, the tree does not care)."""
    tokens, parents = [root], [-1]
    depth = rng.randint(0, min(6, len(stream)))
    for i in range(depth):
        tokens.append(stream[i])
        parents.append(len(tokens) - 2 if i else 0)
    for _ in range(rng.randint(0, 4)):
        parents.append(rng.randrange(len(tokens)))
        tokens.append(rng.choice(stream))
    return tokens, parents


def _two_closers(tokenizer: Any, compiled: Any, max_tokens: int = 30) -> tuple[Any, list[Request]]:
    """Two budget closers and two requests with fresh matchers, to be fed the same tokens."""
    requests = [Request("r", [1], SamplingParams(max_tokens=max_tokens), 0) for _ in range(2)]
    for request in requests:
        request.matcher = compiled.matcher()
        request.compiled = compiled
    return (BudgetCloser(tokenizer), BudgetCloser(tokenizer)), requests


def count_answers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the closing decisions ``Lookahead.take`` hands back (``[count]``, updated live)."""
    answers = [0]
    original_take = closing_ahead.Lookahead.take

    def counting_take(self: Any, here: int, token: int, **kwargs: Any) -> Any:
        outcome = original_take(self, here, token, **kwargs)
        held = kwargs.get("unless_closing") and outcome is not None and outcome[0] is not None
        answers[0] += outcome is not None and not held  # a held closing is taken again
        return outcome

    monkeypatch.setattr(closing_ahead.Lookahead, "take", counting_take)
    return answers


def closing_requests() -> list[Any]:
    """Six constrained requests (three prompts twice) whose budgets end inside their outputs,
    speculating with n-grams and/or forced chains."""
    from espalier.engine.api import GenerationRequest, SpeculativeOptions

    prompts = [(5, 6, 7, 8, 5, 6, 7, 8, 5, 6), (40, 41, 42, 43, 40, 41, 42), (9,) * 20]
    methods = [("ngram", "forced"), ("ngram",), ("forced",)]
    return [
        GenerationRequest(
            f"r{i}",
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=40 + 4 * i),
            grammar=GrammarSpec.json_schema(SCHEMA),
            speculative=SpeculativeOptions(methods=methods[i % 3]),
        )
        for i, prompt in enumerate(prompts * 2)
    ]


# a string no path closes within its budget: its checks' fallbacks run out (FALLBACK_RUNS)
UNCLOSABLE = {"type": "string", "minLength": 1000}


@pytest.mark.parametrize(
    ("schema", "max_tokens"), [(SCHEMA, 30), (UNCLOSABLE, 90)], ids=["closable", "unclosable"]
)
@pytest.mark.parametrize("together", [False, True], ids=["one", "together"])
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_lookahead_decides_like_inline(
    backend: str,
    together: bool,
    schema: dict[str, Any],
    max_tokens: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # together: the step's job of ``BudgetCloser.lookaheads`` (searches in waves, natively)
    tokenizer = toy_tokenizer()
    try:
        compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, backend)
    except SchemaNotEnforceableError:
        pytest.skip(f"{backend} does not enforce {schema}")
    stops = set(tokenizer.stop_token_ids)
    taken = 0
    fallbacks = 0
    # the start path's search has a wall-clock budget: on a loaded machine one closer's could
    # run past it and the other's not (a full run beside two servers: memos differed)
    monkeypatch.setattr(closing, "START_BUDGET_S", 600.0)
    answered = count_answers(monkeypatch)
    for seed in range(8):
        rng = random.Random(seed)
        stream = _stream(tokenizer, compiled, rng, max_tokens + 10)
        (ahead, inline), requests = _two_closers(tokenizer, compiled, max_tokens)
        pos, done = 0, False
        while pos < len(stream) and not done:
            root = stream[pos - 1] if pos else 1
            tree = _tree(stream[pos:], root, rng)
            if together:
                job = ahead.lookaheads([(requests[0], *tree)], 10_000)
            else:
                job = ahead.lookahead(requests[0], *tree, 10_000)
            if job is not None:
                job()
            for token in stream[pos : pos + rng.randint(1, 7)]:
                answers = [
                    closer.instead(request, token, stops, 10_000)
                    for closer, request in ((ahead, requests[0]), (inline, requests[1]))
                ]
                assert answers[0] == answers[1]
                assert ahead._memo.get("r", NO_MEMO) == inline._memo.get("r", NO_MEMO)
                fallbacks = max(fallbacks, inline._memo.get("r", NO_MEMO).fallbacks)
                taken += 1
                pos += 1
                if answers[0] is not None or len(requests[0].output_ids) + 1 >= max_tokens:
                    done = True
                    break
                for request in requests:
                    request.output_ids.append(token)
                    assert request.matcher is not None and request.matcher.accept(token)
    if schema is UNCLOSABLE:  # checks 17 tokens apart: the lookahead answers those
        assert fallbacks == FALLBACK_RUNS  # the cap was reached, ahead and inline alike
        assert answered[0] > 0
    else:
        assert answered[0] > taken // 3  # the lookahead did answer (the rest: off the tree)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_pass_through_takes_lookahead_decisions_like_instead(backend: str) -> None:
    # ``pass_through`` over a step's tokens with a lookahead (one accept call for the run, as
    # ``Engine._accept_run`` does) must answer as ``instead`` token by token: let through
    # exactly the tokens ``instead`` lets through before its first closing or off-tree token.
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), tokenizer, backend)
    stops = set(tokenizer.stop_token_ids)
    runs = closings = 0
    for seed in range(8):
        rng = random.Random(seed)
        stream = _stream(tokenizer, compiled, rng, 40)
        (each, run), requests = _two_closers(tokenizer, compiled)
        pos = 0
        while pos < len(stream):
            root = stream[pos - 1] if pos else 1
            tree = _tree(stream[pos:], root, rng)
            for closer, request in ((each, requests[0]), (run, requests[1])):
                job = closer.lookahead(request, *tree, 10_000)
                if job is not None:
                    job()
            room = 29 - len(requests[0].output_ids)
            step = [t for t in stream[pos : pos + min(rng.randint(1, 7), room)]]
            if not step or any(t in stops for t in step):
                break
            answers: list[Any] = []
            for token in step:
                answers.append(each.instead(requests[0], token, stops, 10_000))
                if answers[-1] is not None:
                    break
                requests[0].output_ids.append(token)
                assert requests[0].matcher is not None and requests[0].matcher.accept(token)
            passed = run.pass_through(requests[1], step, 10_000)
            assert passed <= len(answers) and not any(answers[:passed])
            runs += passed > 1
            taken = step[:passed]
            requests[1].output_ids.extend(taken)
            assert requests[1].matcher is not None
            assert requests[1].matcher.accept_tokens(taken) == len(taken)
            for k in range(passed, len(answers)):
                answer = run.instead(requests[1], step[k], stops, 10_000)
                assert answer == answers[k]
                if answer is None:
                    requests[1].output_ids.append(step[k])
                    assert requests[1].matcher.accept(step[k])
            assert run._memo.get("r", NO_MEMO) == each._memo.get("r", NO_MEMO)
            assert requests[1].output_ids == requests[0].output_ids
            if answers[-1] is not None:
                closings += 1
                break
            pos += len(step)
    assert runs > 8 and closings > 0  # long runs were let through, and some steps closed


def test_speculative_engine_takes_lookahead_decisions(
    toy_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: the speculative engine (decisions ahead) emits the plain engine's tokens."""
    from test_spec_engine import run

    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
    from espalier.engine.spec.strategy import SpecConfig, install
    from tests.fixtures.spec_helpers import random_runner, tiny_config

    answered = count_answers(monkeypatch)
    runner = random_runner(tiny_config(toy_tokenizer.vocab_size), seed=1)
    plain = run(Engine(EngineConfig(), runner, toy_tokenizer), closing_requests())
    engine = Engine(EngineConfig(), runner, toy_tokenizer)
    install(engine, SpecConfig(num_draft_tokens=6), {"ngram": NgramDrafter(NgramConfig(1, 3))})
    spec = run(engine, closing_requests())
    assert {rid: out[0] for rid, out in spec.items()} == {rid: out[0] for rid, out in plain.items()}
    assert answered[0] > 0


def test_no_lookahead_when_no_node_of_the_tree_needs_a_check() -> None:
    # A tree whose deepest check comes before the memo's next check gets no job (the
    # decisions are the memo's, no grammar work); one that reaches it does.
    from espalier.engine.closing import Memo

    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), tokenizer, "llguidance")
    closer = BudgetCloser(tokenizer)
    request = Request("r", [1], SamplingParams(max_tokens=30), 0)
    request.matcher = compiled.matcher()
    request.output_ids.extend([5] * 4)  # here = 4: inside the closing window
    chain = ([1, 2, 3, 4], [-1, 0, 1, 2])  # depth 3: checks at output lengths 4, 5, 6
    closer._memo["r"] = Memo(None, next_check=7)
    assert closer.lookahead(request, *chain, 10_000) is None
    closer._memo["r"] = Memo(None, next_check=6)
    assert closer.lookahead(request, *chain, 10_000) is not None


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_lookahead_decides_only_filled_nodes(backend: str) -> None:
    # A step's job is given the masks' ``filled`` flags over all its trees' nodes: a node left
    # unfilled (verification never accepts it) gets no decision ahead, a filled one does; a
    # token at an unfilled node is decided inline, with the same answer and memo.
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), tokenizer, backend)
    stops = set(tokenizer.stop_token_ids)
    stream = _stream(tokenizer, compiled, random.Random(3), 12)
    closer, inline = BudgetCloser(tokenizer), BudgetCloser(tokenizer)
    requests = {}
    for rid in ("a", "b", "c"):
        requests[rid] = Request(rid, [1], SamplingParams(max_tokens=30), 0)
        requests[rid].matcher = compiled.matcher()
    chain = ([1, *stream[:3]], [-1, 0, 1, 2])
    job = closer.lookaheads([(requests[rid], *chain) for rid in ("a", "b")], 10_000)
    assert job is not None
    filled = np.ones(8, dtype=bool)
    filled[4 + 2] = False  # tree b's second drafted node (and so its third, below it)
    job(filled)
    ahead_a, ahead_b = closer._ahead["a"], closer._ahead["b"]
    for i, token in enumerate(stream[:3]):
        assert ahead_a.decides(i, token)
        assert ahead_b.decides(i, token) == (i == 0)
        answers = set()
        for rid, by in (("a", closer), ("b", closer), ("c", inline)):
            answers.add(repr((by.instead(requests[rid], token, stops, 10_000), by._memo[rid])))
            requests[rid].output_ids.append(token)
            assert requests[rid].matcher is not None and requests[rid].matcher.accept(token)
        assert len(answers) == 1  # decided ahead, inline after an unfilled node, inline: equal


def test_answer_all_hands_each_outcome_over_as_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # a decision that needs no search is handed over before the first wave of searches
    from espalier.engine.closing import SearchCall
    from espalier.engine.closing import batch as closing_batch

    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), tokenizer, "llguidance")
    closer = BudgetCloser(tokenizer)
    assert closer.paths is not None
    events: list[str] = []
    search_all = closing_batch._search_all

    def watched(*args: Any) -> Any:
        events.append("search")
        return search_all(*args)

    monkeypatch.setattr(closing_batch, "_search_all", watched)

    def quick() -> Any:
        return "quick"
        yield  # a generator that yields nothing

    def searching() -> Any:
        accepted, path = yield SearchCall(compiled.matcher(), None, 20)
        return accepted and path is not None

    def done(key: str, outcome: object) -> None:
        events.append(f"{key}={outcome}")

    decisions = {"s": searching(), "q": quick()}
    results = closing_batch.answer_all(closer.paths, decisions, 1, done)
    assert results == {"q": "quick", "s": True}
    assert events == ["q=quick", "search", "s=True"]
