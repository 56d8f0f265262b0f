"""The front door of the grammar layer: pick a backend, refuse what cannot be enforced, compile.

``compile_grammar(spec, tokenizer)`` → ``(CompiledGrammar, CompileReport)``.

For a JSON schema (and each JSON schema inside a structural tag): ``$ref``s are resolved
(:mod:`refs`), exact rewrites applied (:mod:`rewrite`), then each backend's profile
(:mod:`schema_features`) lists the keywords it would not enforce.
Strict mode (the default) compiles only on a backend with no such keyword and otherwise raises
:class:`SchemaNotEnforceableError` naming each keyword and JSON pointer; ``allow_weakening=True``
takes the backend with the fewest issues, compiles the schema without the uses that backend
would refuse outright (:mod:`weaken`) and reports them all in ``CompileReport.weakened``.
``backend="auto"`` tries backends in :data:`AUTO_ORDER` (fastest first, measured by
``bench/masks.py``); other kinds go to the first backend that supports the kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from espalier.constrained.base import CompiledGrammar, CompileReport
from espalier.constrained.errors import (
    CompileTimeoutError,
    EmptyLanguageError,
    FirstMaskLimitError,
    GrammarError,
    InvalidGrammarError,
    KeywordIssue,
    SchemaNotEnforceableError,
    UnsupportedGrammarError,
)
from espalier.constrained.spec import (
    DEFAULT_MAX_GRAMMAR_BYTES,
    BackendName,
    GrammarKind,
    GrammarSpec,
)

if TYPE_CHECKING:
    import referencing

    from espalier.constrained.backends.common import BackendOptions
    from espalier.constrained.schema.number_bounds import NumberBounds
    from espalier.constrained.tokenizer import TokenizerInfo

# Fastest first (bench/masks.py on JSONSchemaBench samples: llguidance compiles lazily in ~ms
# and its masks cost tens of µs; xgrammar precomputes token masks at compile time).
AUTO_ORDER: tuple[BackendName, ...] = (
    BackendName.LLGUIDANCE,
    BackendName.XGRAMMAR,
    BackendName.OUTLINES_CORE,
)


@dataclass(frozen=True)
class PreparedSchema:
    """A schema ready for the backends, with the facts needed to report on it."""

    schema: dict[str, Any] | bool
    issues: dict[str, tuple[KeywordIssue, ...]]  # backend -> keywords it does not enforce
    notes: tuple[str, ...]

    def enforcing(self, order: tuple[str, ...]) -> list[str]:
        """Backends of ``order`` that enforce every keyword."""
        return [b for b in order if not self.issues.get(b)]


def prepare_schema(
    schema: dict[str, Any] | bool,
    registry: referencing.Registry[Any] | None = None,
    backends: tuple[str, ...] = AUTO_ORDER,
    number_bounds: NumberBounds | None = None,
    *,
    track_unique: bool = True,
) -> PreparedSchema:
    """Resolve refs, rewrite, analyse ``schema`` for each backend; raises InvalidGrammarError.

    ``number_bounds``: the number policy the backends will apply (``BackendOptions``); when on,
    bounds past ``2**53`` are clamped to its limits first (``clamp_schema_bounds``).
    ``track_unique``: ``uniqueItems`` the key tracker can follow become its marks
    (:func:`~espalier.constrained.schema.unique_places.mark_unique_items`; the matcher is then
    wrapped by :func:`~espalier.constrained.keys.with_unique_keys`), so no backend refuses
    them; False (a structural tag's schemas, whose matchers are not wrapped): left to refuse."""
    from espalier.constrained.schema.empty import unproductive_pointer
    from espalier.constrained.schema.features import backend_issues
    from espalier.constrained.schema.number_bounds import clamp_schema_bounds
    from espalier.constrained.schema.refs import resolve_refs
    from espalier.constrained.schema.rewrite import normalize_schema

    try:
        resolved = resolve_refs(schema, registry)
        prepared = normalize_schema(resolved.schema)
    except RecursionError as exc:  # a $ref chain of hundreds (nesting is bounded at admission)
        raise InvalidGrammarError(
            GrammarKind.JSON_SCHEMA.value,
            "the schema's $ref chains or nesting are too deep to compile",
        ) from exc
    if number_bounds is not None:
        prepared = clamp_schema_bounds(prepared, number_bounds)
    short: dict[str, tuple[int, int]] = {}
    if track_unique:
        from espalier.constrained.schema.unique_places import cap_listed_items, mark_unique_items

        prepared, short = cap_listed_items(mark_unique_items(prepared))
    empty = unproductive_pointer(prepared)  # "" for false
    if empty is not None and empty in short:
        _refuse_short(short[empty], resolved.display_pointer(empty))
    if prepared is False:
        why = (
            "it is 'false'"
            if schema is False
            else "its keywords exclude each other, or ask for more characters, items or "
            "properties than an output holds"
        )
        raise EmptyLanguageError(
            "json_schema",
            f"the schema matches no value an output can hold ({why})",
            pointer="",
        )
    if empty is not None:
        raise EmptyLanguageError(
            "json_schema",
            "the schema matches no finite JSON value: every value needs the subschema at "
            f"'{resolved.display_pointer(empty)}', which has none (false, more keys than its "
            "names can make, a count past what an output holds, or it must contain itself "
            "without end)",
            pointer=resolved.display_pointer(empty),
        )
    issues = {}
    callers: _Callers | None = None  # two schema walks: made for the first issue only
    for name in backends:
        found = backend_issues(name, prepared)
        if found:
            callers = callers or _Callers(resolved.schema, prepared)
            found = [callers.issue(i) for i in found]
        issues[name] = tuple(
            dict.fromkeys(
                dataclasses.replace(i, pointer=resolved.display_pointer(i.pointer), backend=name)
                for i in found
            )
        )
    notes = (
        (f"resolved $ref into {resolved.hoisted} shared definitions",) if resolved.hoisted else ()
    )
    return PreparedSchema(prepared, issues, notes)


class _Callers:
    """Issues found in the rewritten schema, told in the caller's words: a keyword the caller
    did not write there (``patternProperties`` made of ``propertyNames``, ``required`` under an
    ``allOf`` made of ``minProperties``) is named by the caller's keywords the rewrite replaced
    at the closest place the caller's schema has, with what it became."""

    def __init__(self, given: Any, prepared: Any) -> None:
        from espalier.constrained.schema.walk import walk

        self.given = {node.pointer: node.schema for node in walk(given)}
        self.prepared = {node.pointer: node.schema for node in walk(prepared)}

    def issue(self, issue: KeywordIssue) -> KeywordIssue:
        from espalier.constrained.schema.features import VOCABULARY

        node = self.given.get(issue.pointer)
        if isinstance(node, dict) and issue.keyword in node:
            return issue
        if issue.keyword == "false" and node is False:
            return issue
        at = issue.pointer
        while at and not isinstance(self.given.get(at), dict):
            at = at.rpartition("/")[0]
        given = self.given.get(at)
        if not isinstance(given, dict):
            return issue
        now = self.prepared.get(at)
        now = now if isinstance(now, dict) else {}
        replaced = [k for k in given if k in VOCABULARY and k not in now]
        if not replaced:
            return issue
        made = f"'{issue.keyword}'" + (f" at {issue.pointer}" if issue.pointer != at else "")
        return dataclasses.replace(issue, keyword=", ".join(replaced), pointer=at, via=made)


def prepare_structural_tag(
    spec: GrammarSpec,
    registry: referencing.Registry[Any] | None = None,
    backends: tuple[str, ...] = AUTO_ORDER,
    number_bounds: NumberBounds | None = None,
) -> tuple[GrammarSpec, PreparedSchema]:
    """Each JSON schema of a structural tag prepared as :func:`prepare_schema` does; the issues
    of all of them, their pointers prefixed by the schema's place in the tag."""
    from espalier.constrained.structural_tag import map_json_schemas, root_format, with_format

    issues: dict[str, list[KeywordIssue]] = {name: [] for name in backends}
    notes: list[str] = []

    def prepare(node: dict[str, Any], pointer: str) -> dict[str, Any]:
        prepared = prepare_schema(
            node["json_schema"], registry, backends, number_bounds, track_unique=False
        )
        for name, found in prepared.issues.items():
            issues[name] += [
                dataclasses.replace(i, pointer=f"{pointer}/json_schema{i.pointer}") for i in found
            ]
        notes.extend(prepared.notes)
        return {**node, "json_schema": prepared.schema}

    target = with_format(map_json_schemas(root_format(spec), prepare))
    for name in backends:  # no backend stops an object repeating a key there
        issues[name] += _free_key_issues(target, name)
    merged = PreparedSchema(True, {n: tuple(i) for n, i in issues.items()}, tuple(notes))
    return target, merged


def compile_grammar(
    spec: GrammarSpec,
    tokenizer: TokenizerInfo,
    backend: str = "auto",
    *,
    allow_weakening: bool = False,
    registry: referencing.Registry[Any] | None = None,
    max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
    options: BackendOptions | None = None,
) -> tuple[CompiledGrammar, CompileReport]:
    """Compile ``spec`` for ``tokenizer`` on ``backend`` (a name or ``"auto"``)."""
    from espalier.constrained.backends import BACKENDS

    size = len(spec.source.encode("utf-8"))
    if size > max_bytes:
        raise InvalidGrammarError(
            spec.kind.value, f"grammar is {size} bytes, over the limit of {max_bytes} bytes"
        )
    if backend != "auto" and backend not in BACKENDS:
        from espalier.constrained.errors import UnknownBackendError

        raise UnknownBackendError(backend, ["auto", *BACKENDS])
    order: tuple[str, ...] = AUTO_ORDER if backend == "auto" else (BackendName(backend),)
    bounds = _number_bounds(options)
    if spec.kind is GrammarKind.STRUCTURAL_TAG:
        if backend != "auto":  # refused for the kind, not for the schemas inside
            order = _taking_kind(spec.kind, order, tokenizer, options)
        target, prepared = prepare_structural_tag(spec, registry, order, bounds)
    elif spec.kind is GrammarKind.JSON_SCHEMA:
        prepared = prepare_schema(spec.schema, registry, order, bounds)
        target = GrammarSpec.json_schema(prepared.schema, max_bytes=1 << 30)
    else:
        order = _enforcing_json_blocks(spec, order)
        free = _free_key_issues(spec, order[0])
        compiled = _compile_first(spec, tokenizer, order, options, tuple(free), ())
        if free and not allow_weakening:  # after the compile: a grammar's own faults come first
            raise SchemaNotEnforceableError(free, backend)
        return compiled
    exact = prepared.enforcing(order)
    if exact:
        return _compile_first(target, tokenizer, tuple(exact), options, (), prepared.notes)
    if not allow_weakening:
        if spec.kind is GrammarKind.JSON_SCHEMA:  # "no value matches" says more than a keyword
            _refuse_if_empty(target, tokenizer, options)
        raise SchemaNotEnforceableError(_blocking_issues(prepared, order), backend)
    ranked = tuple(sorted(order, key=lambda b: len(prepared.issues[b])))
    return _compile_first(target, tokenizer, ranked, options, None, prepared.notes, prepared)


def _number_bounds(options: BackendOptions | None) -> NumberBounds | None:
    """The number policy the backends apply under ``options`` (their default when None)."""
    from espalier.constrained.schema.number_bounds import DEFAULT_BOUNDS

    return DEFAULT_BOUNDS if options is None else options.json_number_bounds


def warm_up(
    tokenizer: TokenizerInfo, backend: str = "auto", options: BackendOptions | None = None
) -> None:
    """Pay a process's one-time compile costs now, outside every compile deadline: each
    backend's vocabulary view, the JSON-schema validator's imports (``jsonschema`` builds its
    format checkers' parsers on import: ~1.6 s of CPU, which a first compile that filters an
    ``enum`` used to pay inside its 10 s limit) and one small schema on each backend (xgrammar's
    first compile waits for its compile child to start: 25 s on a loaded 2-core machine, 0.5 s
    for the next one)."""
    from espalier.constrained.backends import get_backend
    from espalier.constrained.postvalidate import schema_validator

    schema_validator({"type": "string"})
    names: tuple[str, ...] = AUTO_ORDER if backend == "auto" else (backend,)
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"enum": [1, "b"]}}})
    for name in names:
        with contextlib.suppress(GrammarError):  # unavailable: compile_grammar reports it
            get_backend(name, tokenizer, options)
            compile_grammar(spec, tokenizer, name, options=options)


def _compile_first(
    spec: GrammarSpec,
    tokenizer: TokenizerInfo,
    order: tuple[str, ...],
    options: BackendOptions | None,
    weakened: tuple[KeywordIssue, ...] | None,
    notes: tuple[str, ...],
    prepared: PreparedSchema | None = None,
) -> tuple[CompiledGrammar, CompileReport]:
    """Compile on the first backend of ``order`` that succeeds; re-raise the first failure.
    ``weakened`` None: the weakening path (each backend compiles :func:`_weakened` and reports
    its own issues from ``prepared``)."""
    from espalier.constrained.backends import get_backend
    from espalier.constrained.schema.productive import refuse_empty_language

    if spec.kind is GrammarKind.JSON_SCHEMA and order[0] != BackendName.LLGUIDANCE:
        _refuse_if_empty(spec, tokenizer, options)
    first_error: GrammarError | None = None
    for name in order:
        start = time.perf_counter()
        try:
            engine = get_backend(name, tokenizer, options)
            if spec.kind not in engine.kinds:
                raise UnsupportedGrammarError(name, spec.kind.value)
            compiled = engine.compile(spec if weakened is not None else _weakened(spec, name))
            refuse_empty_language(compiled, tokenizer)
        except CompileTimeoutError:  # a cache's deadline passed: no other backend has time left
            raise
        except GrammarError as exc:
            if isinstance(exc, EmptyLanguageError) and _schema_verdict(spec, name):
                raise  # llguidance's verdict is the schema's (_refuse_if_empty)
            # a backend that cannot take the grammar, or stopped at a limit of its own, says
            # less than one that found it invalid
            if first_error is None or (
                isinstance(first_error, UnsupportedGrammarError | FirstMaskLimitError)
                and not isinstance(exc, UnsupportedGrammarError | FirstMaskLimitError)
            ):
                first_error = exc
            continue
        issues = weakened if weakened is not None else (prepared.issues[name] if prepared else ())
        report = CompileReport(
            backend=name,
            weakened=issues,
            compile_seconds=time.perf_counter() - start,
            cache_key=spec.cache_key[1],
            notes=notes,
        )
        return compiled, report
    assert first_error is not None
    raise _auto_verdict(spec, first_error, order) if len(order) > 1 else first_error


def _auto_verdict(spec: GrammarSpec, error: GrammarError, order: tuple[str, ...]) -> GrammarError:
    """What auto says when no backend of ``order`` took ``spec``: a feature no backend reads is
    auto's, not the first backend's (``(a)\\1`` named llguidance, and the field
    ``constraint.backend``, which the caller never set)."""
    if isinstance(error, UnsupportedGrammarError):
        backends = ", ".join(str(name) for name in order)
        detail = f"none of {backends} takes it; {error.backend}: {error.detail or error}"
        return UnsupportedGrammarError("auto", error.kind, detail)
    return error


def _schema_verdict(spec: GrammarSpec, backend: str) -> bool:
    """Whether ``backend``'s empty-language verdict on ``spec`` holds for every backend."""
    return backend == BackendName.LLGUIDANCE and spec.kind is GrammarKind.JSON_SCHEMA


def _refuse_if_empty(
    spec: GrammarSpec, tokenizer: TokenizerInfo, options: BackendOptions | None
) -> None:
    """Raise llguidance's :class:`EmptyLanguageError` when it finds that no JSON value matches
    the schema ``spec``; its other errors say nothing here. xgrammar compiled such schemas
    (``{"type": "array", "contains": false}``) into grammars that wrote text of no JSON type at
    all, and outlines-core spent its whole compile timeout on them; llguidance's verdict
    compiles lazily in milliseconds, and it found no false empty in the JSON Schema Test
    Suite's draft 2020-12 schemas (10 of 381 empty, none with a valid instance;
    ``tests/constrained/test_schema_empty.py`` keeps checking)."""
    from espalier.constrained.backends import get_backend

    try:  # without what llguidance cannot compile (multipleOf 99999999 took 9.7 GB): a wider
        # language, so an empty one means the schema's is empty too
        get_backend(BackendName.LLGUIDANCE, tokenizer, options).compile(
            _weakened(spec, BackendName.LLGUIDANCE)
        )
    except EmptyLanguageError:
        raise
    except Exception:  # not a verdict on the schema: the backends asked decide
        return


def _weakened(spec: GrammarSpec, backend: str) -> GrammarSpec:
    """A JSON-schema ``spec`` without the keyword uses ``backend`` refuses at compile
    (:func:`~espalier.constrained.schema.weaken.weakened_schema`; each is in the backend's
    issues, so the report names it); ``spec`` itself when there are none, or for other kinds."""
    from espalier.constrained.schema.weaken import weakened_schema

    if spec.kind is not GrammarKind.JSON_SCHEMA:
        return spec
    schema = weakened_schema(backend, spec.schema)
    return spec if schema is spec.schema else GrammarSpec.json_schema(schema, max_bytes=1 << 30)


def _taking_kind(
    kind: GrammarKind,
    order: tuple[str, ...],
    tokenizer: TokenizerInfo,
    options: BackendOptions | None,
) -> tuple[str, ...]:
    """The backends of ``order`` that compile ``kind``; raises UnsupportedGrammarError if none."""
    from espalier.constrained.backends import get_backend

    taking = tuple(name for name in order if kind in get_backend(name, tokenizer, options).kinds)
    if not taking:
        raise UnsupportedGrammarError(order[0], kind.value)
    return taking


_JSON_BLOCK = re.compile(r"%json\b")
JSON_BLOCK_BACKENDS = (BackendName.LLGUIDANCE,)
"""The backends that enforce a Lark grammar's ``%json`` schemas exactly. llguidance refuses a
keyword it does not implement ("Unimplemented keys"), and a ref it would have to fetch;
xgrammar's Lark front end drops them (``"not"`` ignored: ``n=3`` taken under ``{"not":
{"const": 3}}``; an external ``$ref`` compiled as any JSON value), so a strict request must not
fall back to it."""


def _enforcing_json_blocks(spec: GrammarSpec, order: tuple[str, ...]) -> tuple[str, ...]:
    """``order`` without the backends that would weaken a Lark grammar's ``%json`` schemas
    (all of ``order`` for other grammars); raises UnsupportedGrammarError if none is left."""
    if spec.kind is not GrammarKind.LARK or _JSON_BLOCK.search(spec.source) is None:
        return order
    taking = tuple(name for name in order if name in JSON_BLOCK_BACKENDS)
    if not taking:
        raise UnsupportedGrammarError(
            order[0],
            spec.kind.value,
            "its %json schemas are enforced exactly only by llguidance",
        )
    return taking


def _free_key_issues(spec: GrammarSpec, backend: str) -> list[KeywordIssue]:
    """The JSON values of a Lark grammar or a structural tag whose objects may repeat a key
    that no tracker follows (``keys.matcher.untracked_free_keys``), as weakened keywords."""
    from espalier.constrained.keys.matcher import untracked_free_keys

    return [
        KeywordIssue(keyword, at, "weakened", backend) for at, keyword in untracked_free_keys(spec)
    ]


def _blocking_issues(prepared: PreparedSchema, order: tuple[str, ...]) -> list[KeywordIssue]:
    """The keyword uses no backend enforces; if each is enforced somewhere, the best backend's."""
    sets = [{(i.keyword, i.pointer) for i in prepared.issues[b]} for b in order]
    common = set.intersection(*sets) if sets else set()
    best = min(order, key=lambda b: len(prepared.issues[b]))
    if common:
        seen: set[tuple[str, str]] = set()
        out = []
        for issue in prepared.issues[best]:
            if (issue.keyword, issue.pointer) in common and (
                issue.keyword,
                issue.pointer,
            ) not in seen:
                seen.add((issue.keyword, issue.pointer))
                out.append(issue)
        return out
    return list(prepared.issues[best])


def _refuse_short(counts: tuple[int, int], pointer: str) -> None:
    """An array every value needs, whose unique string items are too few for its minItems
    (``unique_places.cap_listed_items``)."""
    most, least = counts
    raise EmptyLanguageError(
        "json_schema",
        f"the array{f' at {pointer!r}' if pointer else ''} must hold {least} items (minItems), "
        f"but its unique string items can only be {most} distinct strings (uniqueItems with a "
        "pattern or enum that allows those alone)",
        pointer=pointer,
    )
