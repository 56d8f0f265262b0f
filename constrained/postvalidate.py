"""Post-validation: check a finished output text against the full constraint, not the grammar.

The grammar a backend compiles may be weaker than the caller's constraint (``allow_weakening``),
so every final output is checked again here:

- JSON schema: ``jsonschema`` with the schema's own ``$schema`` dialect (Draft 2020-12 when
  absent), format assertion on (``jsonschema[format-nongpl]`` checkers), remote refs only from
  the supplied ``referencing`` registry (none: the bundled meta-schemas alone; nothing is ever
  retrieved from a file or the network), ``pattern`` / ``patternProperties`` through the ``regex``
  module (closer to ECMA-262 than ``re``: it knows ``\\p{L}``). Duplicate object keys, ``NaN``
  and ``Infinity`` are invalid JSON here.
- regex: a full match with the ``regex`` module. Backends use their own dialects (Rust
  ``regex-automata`` for llguidance and outlines-core, xgrammar's own converter); on exotic syntax
  (possessive quantifiers, lookaround, inline flags) the two may disagree, and an error compiling
  the pattern in Python gives ``checked=False`` rather than a verdict.
- choice: membership. any-JSON: parses as strict JSON.
- EBNF / Lark: no independent validator exists in Python; pass ``replay`` (e.g.
  :func:`replay_with`) to replay the text through a fresh matcher, else ``checked=False``. A
  Lark grammar that bounds a rule's tokens (``[max_tokens=N]``) is not replayed either
  (``checked=False``): the replay's tokens are the text's canonical encoding, not the
  generation's, so it would count others.

The result mirrors ``espalier.engine.api.ValidationResult`` (the engine converts it; this package
does not import the engine).
"""

from __future__ import annotations

import contextlib
import decimal
import functools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import regex

from espalier.constrained.spec import GrammarKind, GrammarSpec

if TYPE_CHECKING:
    import referencing

    from espalier.constrained.base import CompiledGrammar
    from espalier.constrained.tokenizer import TokenizerInfo

MAX_ERRORS = 20


@dataclass(frozen=True)
class PostValidation:
    """A verdict (``checked``) and errors, each prefixed by a JSON pointer ("/": root)."""

    checked: bool
    valid: bool
    errors: tuple[str, ...] = ()


_TOKEN_COUNT = re.compile(r"\[\s*max_tokens\s*=")
"""A Lark rule attribute bounding its tokens (``foo[max_tokens=2]: ...``)."""


def postvalidate(
    spec: GrammarSpec,
    text: str,
    *,
    registry: referencing.Registry[Any] | None = None,
    replay: Callable[[str], bool] | None = None,
) -> PostValidation:
    """Validate the final output ``text`` against ``spec``."""
    if spec.kind is GrammarKind.CHOICE:
        ok = text in spec.choices
        return PostValidation(True, ok, () if ok else (f"/: {text!r} is not one of the choices",))
    if spec.kind is GrammarKind.REGEX:
        return _validate_regex(spec.source, text)
    if spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.ANY_JSON):
        try:
            instance = parse_strict_json(text)
        except ValueError as exc:
            return PostValidation(True, False, (f"/: not valid JSON: {exc}",))
        except RecursionError:  # e.g. 8,000 nested arrays: valid JSON, too deep for Python
            return PostValidation(False, False, ("/: nested too deeply to validate",))
        if spec.kind is GrammarKind.ANY_JSON:
            return PostValidation(True, True)
        # keyed on the spec's text: no parse and no serialization of the schema per output
        return _check(_validator_from_text(spec.source, registry), instance)
    if replay is None:
        return PostValidation(False, False, ("/: no independent validator for this grammar kind",))
    if spec.kind is GrammarKind.LARK and _TOKEN_COUNT.search(spec.source) is not None:
        # a replay re-tokenizes the text: its token counts are not the generation's
        return PostValidation(False, False, ("/: the grammar counts tokens (max_tokens)",))
    from espalier.constrained.keys.matcher import repeats_unchecked

    if repeats_unchecked(spec):  # allow_weakening: the grammar takes such repeats
        return PostValidation(
            False, False, ("/: objects of its JSON values may repeat a key, which is not checked",)
        )
    ok = replay(text)
    return PostValidation(True, ok, () if ok else ("/: the grammar does not accept the output",))


def validate_instance(
    schema: dict[str, Any] | bool,
    instance: Any,
    *,
    registry: referencing.Registry[Any] | None = None,
) -> PostValidation:
    """Validate an already-parsed instance against a schema (format assertion on)."""
    return _check(_validator(schema, registry), instance)


def _check(validator: Any, instance: Any) -> PostValidation:
    """``instance`` against ``validator`` within :data:`SCHEMA_CHECK_S`."""
    with time_limit(SCHEMA_CHECK_S):
        return _verdict(validator, instance)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Within it, this thread's validators (:func:`schema_validator`'s too) raise TimeoutError
    once ``seconds`` have passed; outside any, they are not timed. Nested: the sooner deadline
    holds."""
    outer = _deadline.at
    _deadline.at = min(outer, time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.at = outer


def _verdict(validator: Any, instance: Any) -> PostValidation:
    try:
        errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
    except (TimeoutError, MemoryError, RecursionError) as exc:
        return PostValidation(
            False, False, (f"/: the output could not be checked ({type(exc).__name__})",)
        )
    except (re.error, regex.error) as exc:
        return PostValidation(False, False, (f"/: a pattern cannot be compiled in Python: {exc}",))
    except Exception as exc:  # unresolvable refs, broken schemas: no verdict, never a crash
        return PostValidation(False, False, (f"/: schema could not be evaluated: {exc}",))
    messages = tuple(f"{_pointer(list(e.absolute_path))}: {e.message}" for e in errors[:MAX_ERRORS])
    return PostValidation(True, not errors, messages)


def parse_strict_json(text: str) -> Any:
    """``json.loads`` that also rejects duplicate keys, NaN and Infinity (ValueError)."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    return json.loads(text, parse_constant=no_constants, object_pairs_hook=no_duplicates)


def replay_with(compiled: CompiledGrammar, tokenizer: TokenizerInfo) -> Callable[[str], bool]:
    """A ``replay`` that tokenizes the text and pushes it through a fresh matcher, with the
    duplicate-key tracker a generation has (``keys.with_unique_keys``)."""
    from espalier.constrained.keys import with_unique_keys

    def replay(text: str) -> bool:
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
        tokens = tokenizer.encode_text(text)
        return all(matcher.accept(t) for t in tokens) and matcher.can_terminate()

    return replay


def _validate_regex(pattern: str, text: str) -> PostValidation:
    try:
        compiled = regex.compile(pattern)
    except regex.error as exc:
        return PostValidation(False, False, (f"/: the regex cannot be compiled in Python: {exc}",))
    try:
        matched = compiled.fullmatch(text, timeout=REGEX_CHECK_S)
    except (MemoryError, RecursionError, TimeoutError) as exc:  # (?R) recursion, backtracking
        return PostValidation(
            False, False, (f"/: the regex could not be checked in Python ({type(exc).__name__})",)
        )
    if matched:
        return PostValidation(True, True)
    return PostValidation(True, False, (f"/: {text!r} does not fully match the regex",))


REGEX_CHECK_S = 1.0
"""A regex check's time limit: past it (catastrophic backtracking) the output is unchecked."""

SCHEMA_CHECK_S = 1.0
"""A schema check's time limit: past it the output is unchecked. Post-validation runs on the
server's one engine-reader thread: a 2 KB schema (40 levels of ``allOf`` over two refs to the
next level) or a backtracking ``patternProperties`` regex held it, and every request, for good."""


class _Deadline(threading.local):
    at: float = float("inf")


_deadline = _Deadline()


def _remaining() -> float | None:
    """Seconds left of this thread's :func:`time_limit` (None: not within one); TimeoutError
    when none are left."""
    if _deadline.at == float("inf"):
        return None
    left = _deadline.at - time.monotonic()
    if left <= 0:
        raise TimeoutError("schema check")
    return left


def _pointer(path: list[Any]) -> str:
    if not path:
        return "/"
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


VALIDATOR_CACHE_ENTRIES = 256
"""Validators kept per (schema text, registry): building one (class, format checker, ref
resolver) costs ~2 ms, far more than validating a typical output, and requests repeat schemas.
A spec's output is looked up by the spec's own text; the key of a schema object is its JSON
with sorted keys (made per call: for the 32 schemas of ``bench/gpu.py``'s batch, that
serialization alone took as long as validating their outputs, ``bench/postvalidate.py``)."""

_validators: OrderedDict[tuple[str, int], tuple[Any, Any]] = OrderedDict()
_validators_lock = threading.Lock()


def _validator(schema: dict[str, Any] | bool, registry: referencing.Registry[Any] | None) -> Any:
    """A (cached) validator for ``schema``; validators are stateless, so sharing them across
    threads is safe."""
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    return _cached(text, registry, lambda: schema)


def _validator_from_text(text: str, registry: referencing.Registry[Any] | None) -> Any:
    """A (cached) validator for the schema whose JSON is ``text`` (parsed only to build it)."""
    return _cached(text, registry, lambda: json.loads(text))


def _cached(
    text: str,
    registry: referencing.Registry[Any] | None,
    schema: Callable[[], dict[str, Any] | bool],
) -> Any:
    """The validator cached under ``(text, registry)``, else built from ``schema()``."""
    key = (text, id(registry))
    with _validators_lock:
        hit = _validators.get(key)
        if hit is not None and hit[1] is registry:
            _validators.move_to_end(key)
            return hit[0]
    validator = _build_validator(schema(), registry)
    with _validators_lock:
        _validators[key] = (validator, registry)  # the registry is kept: its id stays unique
        while len(_validators) > VALIDATOR_CACHE_ENTRIES:
            _validators.popitem(last=False)
    return validator


@functools.cache
def _extended(base: Any) -> Any:
    """``base`` with our ``pattern`` / ``patternProperties`` (the ``regex`` module's syntax)
    and ``multipleOf`` (decimal arithmetic)."""
    import jsonschema.validators

    keywords = {
        **base.VALIDATORS,
        "pattern": _pattern,
        "patternProperties": _pattern_properties,
        "multipleOf": _multiple_of,
    }
    return jsonschema.validators.extend(base, {k: _timed(f) for k, f in keywords.items()})


def _timed(keyword: Callable[..., Any]) -> Callable[..., Any]:
    """``keyword``'s check, after a look at the clock (:data:`SCHEMA_CHECK_S`): every
    subschema the validator visits passes here, so no schema or instance keeps it longer."""

    def check(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _remaining()
        return keyword(validator, value, instance, schema)

    return check


def _build_validator(
    schema: dict[str, Any] | bool, registry: referencing.Registry[Any] | None
) -> Any:
    import jsonschema
    import jsonschema.validators

    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    from espalier.constrained.schema.guard import LOCAL_REGISTRY

    # jsonschema's default registry retrieves unknown URIs (file:, http:): never use it
    local = registry if registry is not None else LOCAL_REGISTRY
    return _extended(base)(schema, format_checker=base.FORMAT_CHECKER, registry=local)


PATTERN_SEARCH_S = 0.05
"""Time for one search of a user's pattern outside any :func:`time_limit` (the schema
analysis): a short text that takes longer meets catastrophic backtracking."""


def pattern_search(pattern: str, text: str) -> bool | None:
    """Whether ``regex.search(pattern, text)`` (the post-validator's reading of a JSON Schema
    ``pattern``) finds a match; None when ``pattern`` does not compile or the search runs past
    :data:`PATTERN_SEARCH_S` (or this thread's :func:`time_limit`, when sooner): the caller then
    has no verdict. The GIL is released while matching, so a slow pattern never stalls the
    server's other threads."""
    try:
        left = _remaining()
        seconds = PATTERN_SEARCH_S if left is None else min(left, PATTERN_SEARCH_S)
        return regex.search(pattern, text, timeout=seconds, concurrent=True) is not None
    except (regex.error, TimeoutError, ValueError, OverflowError, RecursionError):
        return None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not regex.search(
        pattern, instance, timeout=_remaining(), concurrent=True
    ):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Any:
    """``multipleOf`` on the numbers as written (their shortest decimal spelling), not as
    binary floats: jsonschema's float division called 1.9 no multiple of 0.1."""
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "number") or not validator.is_type(divisor, "number"):
        return
    try:
        with decimal.localcontext() as context:
            context.prec = 2000  # the quotient of 1e308 by 1e-308 is exact within it
            context.traps[decimal.Inexact] = True
            whole = Decimal(repr(instance)) % Decimal(repr(divisor)) == 0
    except (decimal.InvalidOperation, decimal.Inexact, ValueError):
        try:  # past the exact reading: jsonschema's float test
            quotient = instance / divisor
            whole = int(quotient) == quotient
        except (OverflowError, ValueError, ZeroDivisionError):
            whole = False
    if not whole:
        yield ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: Any
) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if regex.search(pattern, key, timeout=_remaining(), concurrent=True):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def schema_validator(
    schema: dict[str, Any] | bool, registry: referencing.Registry[Any] | None = None
) -> Any:
    """A new (uncached) validator for ``schema``, built as the post-validation builds its own:
    the schema's dialect, format assertion on, ``regex`` patterns."""
    return _build_validator(schema, registry)
