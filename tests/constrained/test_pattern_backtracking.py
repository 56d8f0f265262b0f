"""A user's ``pattern`` never runs unbounded in the schema analysis.

The analysis matches patterns against property names and enum members (propertyNames,
patternProperties, oneOf/anyOf members, if/then). With Python's ``re`` a backtracking pattern
over a 60-letter name ran for hours holding the GIL, and every other request of the server
waited (a held-out sweep: ``^(x?)(a+)+\\1$`` over ``a * 32 + "!"`` held a victim request past
its 60 s deadline). Each search is now bounded (``postvalidate.pattern_search``) and an
unfinished one is no verdict: the analysis keeps the schema as it is there.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from espalier.constrained.compile import prepare_schema
from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.postvalidate import pattern_search

EVIL = "^(a|aa)+$"  # exponential in the letters before a mismatch, for any backtracking engine
NAME = "a" * 60 + "b"

SCHEMAS = {
    "propertyNames with a backreference": {
        "type": "object",
        "properties": {NAME: {"const": 1}},
        "required": [NAME],
        "additionalProperties": False,
        "propertyNames": {"pattern": "^(x?)(a+)+\\1$"},
    },
    "propertyNames": {
        "type": "object",
        "properties": {NAME: {"const": 1}},
        "additionalProperties": False,
        "propertyNames": {"pattern": EVIL},
    },
    "patternProperties beside a listed name": {
        "type": "object",
        "properties": {NAME: {"type": "integer"}},
        "patternProperties": {EVIL: {"type": "string"}},
        "additionalProperties": False,
    },
    "not patternProperties": {
        "type": "object",
        "not": {"patternProperties": {EVIL: {"type": "string"}}, "required": [NAME]},
    },
    "enum beside a pattern": {"type": "string", "enum": [NAME, "b"], "pattern": EVIL},
    "oneOf const and pattern": {"oneOf": [{"type": "string", "pattern": EVIL}, {"const": NAME}]},
    "anyOf enum and pattern": {"anyOf": [{"enum": [NAME]}, {"type": "string", "pattern": EVIL}]},
    "if pattern then const": {
        "if": {"type": "string", "pattern": EVIL},
        "then": {"const": NAME},
        "else": {"const": "x"},
    },
}


def _prepare_in_thread(schema: Any) -> tuple[bool, BaseException | None]:
    """Whether ``prepare_schema(schema)`` returned or raised within a minute (unbounded, it
    would take longer than the universe), and what it raised."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            prepare_schema(schema)
            outcome.append(None)
        except BaseException as exc:  # reported to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    return bool(outcome), outcome[0] if outcome else None


@pytest.mark.parametrize("schema", list(SCHEMAS.values()), ids=list(SCHEMAS))
def test_the_analysis_ends_on_a_backtracking_pattern(schema: Any) -> None:
    ended, raised = _prepare_in_thread(schema)
    assert ended, "the analysis still runs a backtracking search"
    assert raised is None or isinstance(raised, InvalidGrammarError), repr(raised)


def test_pattern_search_reads_patterns_as_the_post_validator() -> None:
    assert pattern_search("^a+$", "aaa") is True
    assert pattern_search("b", "abc") is True  # a search, not a full match
    assert pattern_search("^a+$", "aab") is False
    assert pattern_search("\\p{L}", "é") is True  # regex's classes, as the post-validator's
    assert pattern_search("(", "a") is None  # does not compile: no verdict
    assert pattern_search(EVIL, NAME) is None  # runs past its time: no verdict
