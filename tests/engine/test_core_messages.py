"""The engine process's channel: typed errors survive the trip (class, args, attributes), and an
exception that is not the project's, or whose state does not pickle, still carries its message."""

from __future__ import annotations

import pickle
import threading

import pytest

from espalier.constrained.errors import (
    InvalidGrammarError,
    KeywordIssue,
    SchemaNotEnforceableError,
)
from espalier.engine.api import FinishReason, InvalidRequestError, RequestOutput, TokenLogprob
from espalier.engine.core.messages import PortableError, StepOutputs


def _cross(exc: BaseException) -> BaseException:
    return pickle.loads(pickle.dumps(PortableError.of(exc))).rebuild()


@pytest.mark.parametrize(
    "exc",
    [
        InvalidRequestError([("prompt", "must not be empty"), ("top_p", "must be in (0, 1]")]),
        InvalidGrammarError("regex", "unbalanced parenthesis", line=1, column=7),
        SchemaNotEnforceableError([KeywordIssue("uniqueItems", "/tags", "ignored", "xgrammar")]),
    ],
)
def test_project_errors_come_back_as_themselves(exc: Exception) -> None:
    back = _cross(exc)
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert vars(back) == vars(exc)


def test_invalid_request_keeps_its_violations() -> None:
    back = _cross(InvalidRequestError([("request_id", "'a' is already in use")]))
    assert isinstance(back, InvalidRequestError)
    assert back.violations == [("request_id", "'a' is already in use")]


def test_foreign_or_unpicklable_errors_keep_the_message() -> None:
    foreign = _cross(KeyError("missing"))
    assert type(foreign) is RuntimeError and "missing" in str(foreign)
    odd = ValueError("with a lock")
    odd.lock = threading.Lock()  # type: ignore[attr-defined]
    back = _cross(odd)
    assert type(back) is RuntimeError and str(back) == "with a lock"


def test_forged_class_names_do_not_import_or_construct() -> None:
    forged = PortableError("os", "system", "boom", ("true",))
    assert type(forged.rebuild()) is RuntimeError
    not_an_error = PortableError("espalier.engine.api", "RequestOutput", "x")
    assert type(not_an_error.rebuild()) is RuntimeError


def test_a_step_message_round_trips() -> None:
    logprob = TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.5)))
    running = RequestOutput("r1", "", (7, 9), logprobs=(logprob,))  # token chunks: no text
    failed = RequestOutput(
        "r2",
        "",
        (),
        finished=True,
        finish_reason=FinishReason.ERROR,
        error="bad",
        exception=InvalidGrammarError("regex", "bad"),
    )
    done = RequestOutput(
        "r3", "", (5, 1), finished=True, finish_reason=FinishReason.STOP, text_tokens=1
    )
    message = StepOutputs.pack([running, failed, done], {"running": 1}, 3)
    again = pickle.loads(pickle.dumps(message)).outputs()
    assert [o.request_id for o in again] == ["r1", "r2", "r3"]
    assert again[0] == running and again[2] == done
    assert isinstance(again[1].exception, InvalidGrammarError)
    assert again[1].finish_reason is FinishReason.ERROR and again[1].error == "bad"
