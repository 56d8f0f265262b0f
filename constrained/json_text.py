"""A caller's JSON text parsed into values the rest of the system can use, or a located error.

``json.loads`` accepts two things later code cannot handle, and fails a third way that is not a
``JSONDecodeError``:

- a lone UTF-16 surrogate escape (``"\\ud800"`` with no pair) decodes to a ``str`` that no UTF-8
  encoder takes (a grammar's cache key, every backend, the chat template);
- a raw surrogate in the text itself (possible from Python callers, never from gRPC);
- an integer of more than ``sys.get_int_max_str_digits()`` digits (4,300) raises a plain
  ``ValueError``;
- a number past a float64's range (``1e400`` reads as ``inf``, which ``json.dumps`` writes as
  ``Infinity``, no JSON; ``10**400`` is an ``int`` no backend reads): every grammar backend
  reads numbers as float64 or int64 ("number out of range", "null is not of type number").

:func:`loads` refuses all four as :class:`JSONTextError` with a line and column, where the text is
first read, so a caller's mistake is an INVALID_ARGUMENT with its place, never an INTERNAL error.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_PAIR = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")


class JSONTextError(ValueError):
    """The text is not JSON this system takes; ``line`` and ``column`` are 1-based."""

    def __init__(self, msg: str, line: int | None = None, column: int | None = None) -> None:
        self.msg = msg
        self.line = line
        self.column = column
        where = f" (line {line}, column {column})" if line is not None else ""
        super().__init__(f"{msg}{where}")


def loads(text: str) -> Any:
    """``json.loads(text)``, refusing what the module docstring lists; raises JSONTextError."""
    try:
        value = json.loads(text, parse_float=_float, parse_int=_int)
    except json.JSONDecodeError as exc:
        raise JSONTextError(exc.msg, exc.lineno, exc.colno) from exc
    except _PastFloat64 as exc:
        line, column = _position(text, text.find(exc.literal))
        raise JSONTextError(
            f"the number {exc.literal[:20]}{'...' if len(exc.literal) > 20 else ''} is past "
            "the range of a float64 (about 1.8e308), in which numbers are read",
            line,
            column,
        ) from exc
    except RecursionError as exc:
        raise JSONTextError("nested too deeply") from exc
    except ValueError as exc:  # an integer longer than Python converts from text
        line, column = _position(text, _long_integer(text))
        limit = sys.get_int_max_str_digits()
        raise JSONTextError(f"a number has more than {limit} digits", line, column) from exc
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        line, column = _position(text, exc.start)
        raise JSONTextError("the text holds a lone surrogate, not Unicode", line, column) from exc
    if _SURROGATE_ESCAPE.search(text) is not None:
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            line, column = _position(text, _lone_escape(text))
            raise JSONTextError(
                "a \\u escape is a lone UTF-16 surrogate (\\ud800-\\udfff not in a pair), "
                "not Unicode",
                line,
                column,
            ) from exc
    return value


class _PastFloat64(ValueError):
    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def _float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise _PastFloat64(literal)
    return value


def _int(literal: str) -> int:
    value = int(literal)  # past int_max_str_digits: the plain ValueError loads reports
    if abs(value) >= _FLOAT64_END:
        raise _PastFloat64(literal)
    return value


_FLOAT64_END = 2**1024  # the first integer past the largest float64


def _long_integer(text: str) -> int | None:
    limit = sys.get_int_max_str_digits()
    found = re.search(rf"\d{{{limit + 1},}}", text)
    return found.start() if found is not None else None


def _lone_escape(text: str) -> int | None:
    """The offset of the first surrogate escape that is not half of a high-low pair."""
    paired: set[int] = set()
    for pair in _PAIR.finditer(text):
        paired.update((pair.start(), pair.start() + 6))
    for escape in _SURROGATE_ESCAPE.finditer(text):
        if escape.start() not in paired:
            return escape.start()
    return None


def _position(text: str, offset: int | None) -> tuple[int | None, int | None]:
    if offset is None:
        return None, None
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1
