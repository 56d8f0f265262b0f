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
from espalier.engine.api import FinishReason, InvalidRequestError, RequestOutput
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


def test_a_step_message_pickles_without_the_exception_object() -> None:
    out = RequestOutput("r1", "", (), finished=True, finish_reason=FinishReason.ERROR, error="e")
    message = StepOutputs((out,), {"r1": PortableError.of(ValueError("e"))}, {"running": 0}, 1)
    again = pickle.loads(pickle.dumps(message))
    assert again.outputs[0].request_id == "r1" and again.adds_applied == 1
