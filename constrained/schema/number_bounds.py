"""Bounded JSON numbers: a generation policy that keeps every emitted number usable.

JSON Schema puts no limit on how many digits a number has, so a grammar for ``{"type":
"integer"}`` lets a model write ``1000000...`` until it runs out of tokens (greedy small models
do). :class:`NumberBounds` (``BackendOptions.json_number_bounds``, on by default, ``None`` turns
it off) narrows only what the *grammar* allows; the caller's schema and its post-validation are
untouched, and the narrowed language is a subset of the original, so every output still
validates under the caller's schema:

- an ``integer`` without a bound on a side gets ``-integer_limit`` / ``integer_limit`` there
  (default ``2**53 - 1``: the I-JSON interoperable range, RFC 7493 §2.2: exact in a float64, a
  JavaScript number, an int64);
- a ``number`` without a bound on a side gets ``exclusiveMinimum: -10**number_integer_digits``
  / ``exclusiveMaximum: 10**number_integer_digits`` there, at most ``number_fraction_digits``
  digits after the point and no exponent;
- a bound past ``2**53`` in magnitude (read as a float64 by the backends: not enforced
  exactly) is replaced by the limit on that side (:func:`clamp_schema_bounds`, before the
  keyword profiles): no emitted number reaches it under the policy anyway.

How each backend is told (all three compile the same narrowed language up to the notes):

- llguidance: the bounds as ``minimum``/``maximum``/``exclusive*`` keywords, plus
  ``multipleOf: 10**-number_fraction_digits`` (llguidance matches decimal ``multipleOf``
  exactly, digit by digit) unless the node has its own ``multipleOf`` or its range is narrower
  than three such steps (``[0.1, 0.1]``: llguidance's float arithmetic found no multiple in it
  and called the schema empty; ``(0.25, 0.2500009)`` holds none);
- xgrammar: the same bound keywords; its range grammar allows at most 6 fraction digits
  whatever ``number_fraction_digits`` says (xgrammar ignores ``multipleOf`` on numbers). A node
  with ``multipleOf`` is left unbounded: xgrammar drops ``multipleOf`` next to a range;
- outlines-core: its regex's unbounded integer and number sub-regexes are replaced by
  :meth:`NumberBounds.integer_regex` / :meth:`NumberBounds.number_regex` (it only counts
  digits: ``integer_limit`` becomes the digit count every value of which fits). This also covers
  numbers inside untyped (any-JSON) values, which the keyword route cannot reach.

Keywords are added only where narrowing a subschema narrows the whole schema: ``properties``,
``patternProperties``, ``additionalProperties``, ``items``, ``prefixItems``, ``allOf``,
``anyOf``, ``then``/``else`` and ``$defs`` (the latter only when nothing in the schema sits under
``not``, ``if``, ``oneOf``, ``contains`` or ``unevaluated*``, where narrowing could widen).
A node with ``enum``/``const`` is already finite and left alone; a bound is not added when the
caller's opposite bound lies beyond it (the result would be empty). A node of several types
(``["integer", "null"]``) with no other keywords than numeric ones is split into an ``anyOf`` of
one branch per type (exact), since xgrammar applies bounds only under a single type.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, TypeGuard

from espalier.constrained.spec import BackendName

# llguidance reads numeric bounds as float64: larger integer bounds would be rounded
MAX_EXACT_INTEGER = 2**53 - 1
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
     "writeOnly"}
)  # fmt: skip
_NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_POSITIVE_SINGLE = ("additionalProperties", "items", "then", "else")
_POSITIVE_LISTED = ("allOf", "anyOf", "prefixItems")
_POSITIVE_NAMED = ("properties", "patternProperties")
_DEFS = ("$defs", "definitions")
_WIDENING = ('"not"', '"if"', '"oneOf"', '"contains"', '"unevaluatedProperties"',
             '"unevaluatedItems"')  # fmt: skip


@dataclass(frozen=True)
class NumberBounds:
    """How far JSON numbers may go in generated output (see the module docstring).

    Attributes:
        integer_limit: an ``integer`` stays within ``[-integer_limit, integer_limit]`` unless the
            schema bounds it; at most ``2**53 - 1`` (llguidance reads bounds as float64).
        number_integer_digits: a ``number`` stays within ``(-10**d, 10**d)`` unless the schema
            bounds it (15: its integer part alone is exact in a float64).
        number_fraction_digits: most digits after a ``number``'s decimal point (xgrammar: 6).
    """

    integer_limit: int = MAX_EXACT_INTEGER
    number_integer_digits: int = 15
    number_fraction_digits: int = 6

    def __post_init__(self) -> None:
        if not 1 <= self.integer_limit <= MAX_EXACT_INTEGER:
            raise ValueError(f"integer_limit must be in [1, 2**53 - 1], got {self.integer_limit}")
        if not 1 <= self.number_integer_digits <= 22 or self.number_fraction_digits < 0:
            raise ValueError(f"invalid number digit counts in {self}")

    @property
    def integer_digits(self) -> int:
        """Most digits such that every integer of that many digits is within the limit."""
        return len(str(self.integer_limit + 1)) - 1

    def integer_regex(self) -> str:
        """A JSON integer of at most :attr:`integer_digits` digits."""
        return rf"(-)?(0|[1-9][0-9]{{0,{self.integer_digits - 1}}})"

    def number_regex(self) -> str:
        """A JSON number with a bounded integer part and fraction and no exponent."""
        whole = rf"(-)?(0|[1-9][0-9]{{0,{self.number_integer_digits - 1}}})"
        if self.number_fraction_digits == 0:
            return whole
        return rf"{whole}(\.[0-9]{{1,{self.number_fraction_digits}}})?"


DEFAULT_BOUNDS = NumberBounds()  # BackendOptions' default


def bound_schema_numbers(schema: Any, backend: str, bounds: NumberBounds) -> Any:
    """``schema`` with bound keywords added for ``backend`` ("llguidance" or "xgrammar")."""
    if not isinstance(schema, dict):
        return schema
    text = json.dumps(schema)
    walker = _Walker(bounds, backend, not any(k in text for k in _WIDENING))
    return walker.visit(schema)


def clamp_schema_bounds(schema: Any, bounds: NumberBounds) -> Any:
    """``schema`` with each numeric bound past ``2**53`` in magnitude replaced by the policy's
    limit on that side (``integer_limit``; ``10**number_integer_digits``, exclusive, when the
    node also takes non-integral numbers), on nodes typed ``integer`` / ``number`` at the
    positions :func:`bound_schema_numbers` visits. The backends read such a bound as a float64
    (llguidance: neighbours collapse; xgrammar refuses integers past int64); under the policy
    no emitted number reaches it, so the clamp narrows nothing the policy keeps. Applied before
    the keyword profiles (``compile.prepare_schema``) only when the policy is on; a bound whose
    opposite side already lies past the limit is left alone (the clamp would empty the node)."""
    if not isinstance(schema, dict):
        return schema
    text = json.dumps(schema)
    return _Walker(bounds, "", not any(k in text for k in _WIDENING), clamp=True).visit(schema)


def bound_number_regex(regex: str, integer_rx: str, number_rx: str, bounds: NumberBounds) -> str:
    """outlines-core's ``regex`` with its sub-regexes ``integer_rx`` / ``number_rx`` (its own
    unbounded spellings, ``outlines_core.json_schema.INTEGER`` / ``NUMBER``) bounded."""
    number = f"(?:{bounds.number_regex()})"
    integer = f"(?:{bounds.integer_regex()})"
    # the number spelling contains the integer one: replace numbers first, then what is left
    parts = regex.split(number_rx)
    return number.join(part.replace(integer_rx, integer) for part in parts)


class _Walker:
    """Visits the positions where narrowing a subschema narrows the whole schema; ``clamp``:
    :func:`clamp_schema_bounds`' change at each node, else :func:`bound_schema_numbers`'."""

    def __init__(self, bounds: NumberBounds, backend: str, defs: bool, clamp: bool = False) -> None:
        self.bounds = bounds
        self.backend = backend
        self.defs = defs
        self.clamp = clamp

    def visit(self, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key in _POSITIVE_SINGLE:
            if isinstance(out.get(key), dict):
                out[key] = self.visit(out[key])
        for key in _POSITIVE_LISTED:
            if isinstance(out.get(key), list):
                out[key] = [self.visit(sub) for sub in out[key]]
        for key in _POSITIVE_NAMED + (_DEFS if self.defs else ()):
            if isinstance(out.get(key), dict):
                out[key] = {name: self.visit(sub) for name, sub in out[key].items()}
        return self._clamp(out) if self.clamp else self._bound(out)

    def _clamp(self, node: dict[str, Any]) -> dict[str, Any]:
        types = node.get("type")
        type_list = [types] if isinstance(types, str) else types
        if not isinstance(type_list, list) or "enum" in node or "const" in node:
            return node
        if "number" in type_list:
            limit, low_key, high_key = (
                10**self.bounds.number_integer_digits, "exclusiveMinimum", "exclusiveMaximum"
            )  # fmt: skip
        elif "integer" in type_list:
            limit, low_key, high_key = self.bounds.integer_limit, "minimum", "maximum"
        else:
            return node
        if any(not is_number(node[k]) for k in _NUMERIC if k in node):
            return node
        out = dict(node)
        for sign, keys, opposite, key in (
            (1, ("maximum", "exclusiveMaximum"), ("minimum", "exclusiveMinimum"), high_key),
            (-1, ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum"), low_key),
        ):
            past = [k for k in keys if k in out and sign * out[k] > MAX_EXACT_INTEGER + 1]
            if not past or any(sign * out[k] >= limit for k in opposite if k in out):
                continue
            for k in past:
                del out[k]
            if not any(k in out for k in keys):
                out[key] = sign * limit
        return out

    def _bound(self, node: dict[str, Any]) -> dict[str, Any]:
        types = node.get("type")
        type_list = [types] if isinstance(types, str) else types
        if not isinstance(type_list, list) or "enum" in node or "const" in node:
            return node
        if not {"integer", "number"} & set(type_list):
            return node
        if len(type_list) == 1:
            return self._bound_typed(node, type_list[0])
        if not set(node) <= {"type"} | _ANNOTATIONS | _NUMERIC:
            return node  # other keywords: splitting would need their types too; left as is
        numeric = {k: v for k, v in node.items() if k in _NUMERIC}
        branches = [
            self._bound_typed({"type": t, **numeric}, t)
            if t in ("integer", "number")
            else {"type": t}
            for t in type_list
        ]
        rest = {k: v for k, v in node.items() if k in _ANNOTATIONS}
        return {**rest, "anyOf": branches}

    def _bound_typed(self, node: dict[str, Any], kind: str) -> dict[str, Any]:
        if any(not is_number(node[k]) for k in _NUMERIC if k in node):
            return node  # a malformed bound: not ours to interpret
        if self.backend == BackendName.XGRAMMAR and "multipleOf" in node:
            return node  # xgrammar drops multipleOf next to a range ("not yet supported")
        if kind == "integer":
            node = _whole_bounds(node)
        lows = [node[k] for k in ("minimum", "exclusiveMinimum") if k in node]
        highs = [node[k] for k in ("maximum", "exclusiveMaximum") if k in node]
        out = dict(node)
        if kind == "integer":
            limit: int = self.bounds.integer_limit
            low_key, high_key = "minimum", "maximum"
        else:
            limit = 10**self.bounds.number_integer_digits
            low_key, high_key = "exclusiveMinimum", "exclusiveMaximum"
        if not lows and (not highs or min(highs) > -limit):
            out[low_key] = -limit
        if not highs and (not lows or max(lows) < limit):
            out[high_key] = limit
        step = 10.0**-self.bounds.number_fraction_digits
        # a narrow range may hold no multiple (or llguidance's floats miss the one it holds)
        narrow = bool(lows and highs) and min(highs) - max(lows) < 3 * step
        llguidance = self.backend == BackendName.LLGUIDANCE
        if kind == "number" and llguidance and "multipleOf" not in node and not narrow:
            out["multipleOf"] = step
        return out


def _whole_bounds(node: dict[str, Any]) -> dict[str, Any]:
    """An ``integer`` node whose bounds are not all whole numbers, with its bounds as the
    inclusive whole ``minimum`` / ``maximum`` that take the same integers (``exclusiveMinimum:
    0.5`` is ``minimum: 1``): xgrammar refuses a fractional bound on an integer ("Integer
    constraint must be a whole number"); the language is the same. Bounds are numbers (the
    caller checked)."""
    keys = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
    values = [node[k] for k in keys if k in node]
    if all(isinstance(v, int) or not math.isfinite(v) or v.is_integer() for v in values):
        return node  # whole already, or a non-finite bound: not ours to rewrite
    lows = [math.ceil(node["minimum"])] if "minimum" in node else []
    lows += [math.floor(node["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in node else []
    highs = [math.floor(node["maximum"])] if "maximum" in node else []
    highs += [math.ceil(node["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in node else []
    out = {k: v for k, v in node.items() if k not in keys}
    if lows:
        out["minimum"] = max(lows)
    if highs:
        out["maximum"] = min(highs)
    return out


def is_number(value: Any) -> TypeGuard[int | float]:
    """A JSON number as Python reads one (an int or a float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
