"""No request can hurt another inside the engine step, and closing tokens carry logprobs.

A request whose own grammar raises (llguidance's matcher state error on a 2,001-option choice,
or any fault in its mask fill or accept) ends alone with ``ERROR``: typed (its input's fault)
or internal with a message naming only the exception's type; so does one whose grammar's masks
grow too slow to keep in the batch (``constrained/fill_cost.py``); a concurrent request finishes
with exactly the tokens it gets alone, in plain and in speculative steps. With logprobs asked
for, every emitted token has an entry, the closing path's tokens and stop token included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from espalier.constrained import fill_cost
from espalier.constrained.errors import GrammarCostError, GrammarError
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import (
    ConstraintOptions,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SpeculativeOptions,
)
from espalier.engine.engine import Engine
from espalier.engine.spec.strategy import SpecConfig, install
from tests.fixtures.engine_fixtures import CLOSING_SCHEMA, drain, make_engine, run_all, tokens_of
from tests.fixtures.looping_model import looping_engine

MANY_OPTIONS = [f"option-{i:04d}-{'x' * (i % 7)}" for i in range(2001)]


def _engine(speculative: bool) -> Engine:
    engine = make_engine()
    if speculative:
        install(engine, SpecConfig(methods=("forced",), num_draft_tokens=4), {})
    return engine


def _victim(request_id: str = "victim", backend: str = "llguidance") -> GenerationRequest:
    return GenerationRequest(
        request_id,
        prompt="hello world",
        sampling=SamplingParams(max_tokens=30),
        grammar=GrammarSpec.json_schema(CLOSING_SCHEMA),
        constraint=ConstraintOptions(backend=backend),
    )


def _solo(speculative: bool, backend: str = "llguidance") -> list[int]:
    chunks = run_all(_engine(speculative), [_victim(backend=backend)])["victim"]
    assert chunks[-1].finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR)
    return tokens_of(chunks)


@pytest.mark.parametrize("speculative", [False, True])
def test_a_choice_llguidance_cannot_match_ends_alone(speculative: bool) -> None:
    attacker = GenerationRequest(
        "attacker",
        prompt="pick one",
        sampling=SamplingParams(max_tokens=12),
        grammar=GrammarSpec.choice(MANY_OPTIONS),
        constraint=ConstraintOptions(backend="llguidance"),
        speculative=SpeculativeOptions(enabled=speculative),
    )
    chunks = run_all(_engine(speculative), [_victim(), attacker, _victim("victim-2")])
    last = chunks["attacker"][-1]
    assert last.finish_reason is FinishReason.ERROR
    # its own input's fault: typed for INVALID_ARGUMENT (whether refused at compile or raised
    # in the step), naming nothing of the other requests
    assert isinstance(last.exception, GrammarError), last
    assert "victim" not in (last.error or "")
    solo = _solo(speculative)
    for victim in ("victim", "victim-2"):
        assert chunks[victim][-1].finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR)
        assert tokens_of(chunks[victim]) == solo


def _break_after(engine: Engine, request_id: str, method: str, calls: int) -> Callable[[], int]:
    """Make ``request_id``'s own matcher raise RuntimeError from its ``calls``-th ``method``
    call on (a fault of that request's grammar state); returns a counter of the raises."""
    raised = [0]
    poll = engine._poll_grammars

    def poll_and_arm(outputs: list[Any]) -> None:
        poll(outputs)
        request = engine._requests.get(request_id)
        matcher = None if request is None else request.matcher
        # the library's matcher itself: a key-tracking wrapper (constrained/keys/) has its inner
        # matcher filled in the batch call, and calls into it for accept and fork
        matcher = getattr(matcher, "inner", matcher)
        if matcher is None or getattr(matcher, "_armed", False):
            return
        real = getattr(matcher, method)
        seen = [0]

        def faulty(*args: Any, **kwargs: Any) -> Any:
            seen[0] += 1
            if seen[0] >= calls:
                raised[0] += 1
                raise RuntimeError("secret state of the faulty request")
            return real(*args, **kwargs)

        setattr(matcher, method, faulty)
        matcher._armed = True

    engine._poll_grammars = poll_and_arm  # type: ignore[method-assign]
    return lambda: raised[0]


@pytest.mark.parametrize(
    ("speculative", "method", "backend"),
    [
        (False, "fill_bitmask", "outlines_core"),
        # its accepts: all in the step's batch call, which asks this of each run first
        (False, "takes_all_natively", "llguidance"),
        (True, "completes", "llguidance"),  # its closing checks (the searches fork no more)
        (True, "accept", "xgrammar"),
    ],
)
def test_a_fault_in_one_requests_grammar_ends_that_request_alone(
    speculative: bool, method: str, backend: str
) -> None:
    engine = _engine(speculative)
    raised = _break_after(engine, "faulty", method, calls=3)
    faulty = _victim("faulty", backend)
    chunks = run_all(engine, [faulty, _victim(backend=backend)])
    assert raised() > 0
    last = chunks["faulty"][-1]
    assert last.finish_reason is FinishReason.ERROR
    assert last.exception is None  # not the user's fault: internal
    assert last.error is not None and "RuntimeError" in last.error
    assert "secret" not in last.error and "victim" not in last.error
    assert chunks["victim"][-1].finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR), chunks[
        "victim"
    ][-1].error
    assert tokens_of(chunks["victim"]) == _solo(speculative, backend)


def test_a_request_whose_sampling_raises_ends_alone() -> None:
    """A sampled request whose generator cannot draw (its own state) makes the batch's
    sampler raise: the step samples row by row, ends that request alone, and the greedy
    victim's tokens are those of its solo run."""
    engine = _engine(False)
    faulty = GenerationRequest(
        "faulty", prompt="abc", sampling=SamplingParams(max_tokens=40, temperature=0.8, seed=3)
    )
    engine.add_request(faulty)
    engine.add_request(_victim())
    early: list[Any] = []
    while not any(out.request_id == "victim" and out.token_ids for out in early):
        early.extend(engine.step())  # until both run in one batch
    engine._requests["faulty"].generator = "not a generator"  # type: ignore[assignment]
    chunks = drain(engine)
    for out in reversed(early):
        chunks.setdefault(out.request_id, []).insert(0, out)
    assert not any(out.finished for out in early)
    last = chunks["faulty"][-1]
    assert last.finish_reason is FinishReason.ERROR and last.exception is None
    assert last.error is not None and "victim" not in last.error
    assert tokens_of(chunks["victim"]) == _solo(False)


@pytest.mark.parametrize("speculative", [False, True])
def test_closing_tokens_carry_logprobs(speculative: bool) -> None:
    requests = [
        GenerationRequest(
            f"r{i}",
            prompt=prompt,
            sampling=SamplingParams(max_tokens=24, logprobs=2),
            grammar=GrammarSpec.json_schema(CLOSING_SCHEMA),
            constraint=ConstraintOptions(backend=backend),
        )
        for i, (prompt, backend) in enumerate(
            [("abc", "llguidance"), ("hello world", "xgrammar"), ("0123", "outlines_core")]
        )
    ]
    closed = 0
    for chunks in run_all(_engine(speculative), requests).values():
        tokens = tokens_of(chunks)
        logprobs = [lp for c in chunks for lp in c.logprobs]
        assert [lp.token_id for lp in logprobs] == tokens
        assert all(lp.top for lp in logprobs)
        if chunks[-1].finish_reason is FinishReason.STOP and len(tokens) >= 20:
            closed += 1
    assert closed > 0  # the closing path did run (random weights loop inside the array)


AMBIGUOUS = {  # every split of the text is a parse: the parser's work grows with each token
    "llguidance": GrammarSpec.lark('start: s\ns: s s | "a" | "b" | s "a" s\n'),
    "xgrammar": GrammarSpec.ebnf('root ::= s\ns ::= s s | "a" | "b" | s "a" s\n'),
}


@pytest.mark.parametrize(
    ("speculative", "backend"),
    # llguidance's trees: its native tree batch reports each tree's time; xgrammar's alone;
    # a matcher once slow is filled on a helper thread, abandoned at its limit (bounded.py)
    [(False, "llguidance"), (False, "xgrammar"), (True, "llguidance"), (True, "xgrammar")],
)
def test_a_grammar_whose_masks_grow_slow_is_ended_and_the_batch_goes_on(
    speculative: bool, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ambiguous grammar's masks take longer with every token (seconds each after a few
    hundred on Gemma); its request ends with GrammarCostError once they stay over the limit
    (lowered here, so that the toy model reaches it in tens of tokens), and the request batched
    with it gets exactly the tokens it gets alone."""
    monkeypatch.setattr(fill_cost, "SLOW_FILL_S", 0.015)
    monkeypatch.setattr(fill_cost, "DEBT_S", 0.05)

    def run(with_attacker: bool) -> dict[str, list[Any]]:
        engine = looping_engine("ab")
        if speculative:
            install(engine, SpecConfig(methods=("forced",), num_draft_tokens=4), {})
        attacker = GenerationRequest(
            "attacker",
            prompt="ab",
            sampling=SamplingParams(max_tokens=400),
            grammar=AMBIGUOUS[backend],
            constraint=ConstraintOptions(backend=backend),
        )
        victim = GenerationRequest(
            "victim",
            prompt="ab",
            sampling=SamplingParams(max_tokens=30),
            grammar=GrammarSpec.json_schema(CLOSING_SCHEMA),
            constraint=ConstraintOptions(backend="llguidance"),
        )
        return run_all(engine, [attacker, victim] if with_attacker else [victim])

    chunks = run(True)
    last = chunks["attacker"][-1]
    assert last.finish_reason is FinishReason.ERROR
    assert isinstance(last.exception, GrammarCostError), last.error
    assert len(tokens_of(chunks["attacker"])) < 400  # ended long before its max_tokens
    assert chunks["victim"][-1].finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR), chunks[
        "victim"
    ][-1].error
    assert tokens_of(chunks["victim"]) == tokens_of(run(False)["victim"])


def _json_request(request_id: str, sampling: SamplingParams) -> GenerationRequest:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    grammar = GrammarSpec.json_schema(schema)
    return GenerationRequest(request_id, prompt="Write: Write:", sampling=sampling, grammar=grammar)


def test_a_temperature_below_the_minimum_samples_greedily() -> None:
    """``logits / 1e-45`` is inf and NaN: such a request drew masked-out tokens (plain) or none
    at all, forever (speculative). Temperatures below MIN_TEMPERATURE are greedy."""
    tiny = SamplingParams(temperature=1e-45, max_tokens=12, seed=1)
    assert tiny.temperature == 0.0 and SamplingParams(temperature=1e-5).temperature == 1e-5
    greedy = SamplingParams(max_tokens=12)
    for speculative in (False, True):
        chunks = run_all(_engine(speculative), [_json_request("tiny", tiny)])["tiny"]
        assert chunks[-1].finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR)
        solo = run_all(_engine(speculative), [_json_request("greedy", greedy)])["greedy"]
        assert tokens_of(chunks) == tokens_of(solo)


def test_a_verify_step_that_draws_no_token_ends_its_request() -> None:
    """Rows with no finite logit (a temperature past the API's checks, here forced in) gave
    speculative steps that emitted nothing, and the request never ended; it now ends ERROR, and
    a request beside it finishes with its solo tokens."""
    broken = SamplingParams(temperature=1.0, max_tokens=10, seed=1)
    object.__setattr__(broken, "temperature", 1e-45)
    engine = _engine(True)
    chunks = run_all(engine, [_json_request("broken", broken), _victim()])
    last = chunks["broken"][-1]
    assert last.finish_reason is FinishReason.ERROR and "RuntimeError" in (last.error or "")
    assert tokens_of(chunks["victim"]) == _solo(True)
