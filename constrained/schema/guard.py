"""Admission checks for a JSON schema from a caller: bounded nesting, a valid schema, local refs.

:func:`admit_schema` runs before anything else reads a caller's schema text:

1. nesting depth is measured on the text itself (no recursion, strings skipped) and refused past
   ``max_depth``: a 100k-deep document never reaches ``json.loads`` or a recursive walk;
2. the parsed schema is validated against its meta-schema (the ``$schema`` dialect when it is a
   known draft, else Draft 2020-12; the meta-schemas are bundled, none is fetched), so
   ``{"minLength": -1}`` is refused with its pointer;
3. every ``$ref`` / ``$dynamicRef`` / ``$recursiveRef`` must resolve inside the schema itself or
   the bundled meta-schemas: :data:`LOCAL_REGISTRY` has no retrieval, so no URI (``file:``,
   ``http(s):``, anything) ever opens a file or a socket, and one that does not resolve locally is
   refused with the JSON pointer of the keyword;
4. no ``pattern`` asks for more copies of one atom than ``regex_dialect.MAX_REPEAT`` (before
   anything compiles it: Python's ``regex`` module writes ``a{100000000}`` out in full);
5. no schema object names more than :data:`MAX_NAMES_PER_OBJECT` properties (``properties``
   and ``required`` together), and the schema no more than :data:`MAX_NAMES` in all: each
   name is a lexeme of the grammar, and the closing search's matcher forks copy the lexer
   (20,000 required names took the engine past 8 GB and it aborted; 2,000 cost 0.4 GB).

Every refusal is an :class:`InvalidGrammarError` of kind ``json_schema`` with a pointer.
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any

import referencing
import referencing.exceptions
import referencing.jsonschema
from jsonschema_specifications import REGISTRY as METASCHEMAS

from espalier.constrained import json_text
from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.schema.walk import escape_pointer_token, walk

LOCAL_REGISTRY: referencing.Registry[Any] = METASCHEMAS
"""The bundled meta-schemas and nothing else; its ``retrieve`` refuses every unknown URI."""

MAX_NAMES_PER_OBJECT = 2_000
"""Property names one schema object may list (JSONSchemaBench's largest lists 1,174)."""
MAX_NAMES = 10_000
"""Property names a schema may list in all (JSONSchemaBench's largest: 4,628)."""

DEFAULT_MAX_SCHEMA_DEPTH = 128
"""Brackets (objects + arrays) nested in a schema's JSON text. A real schema nested 60
properties deep is 120 levels; recursive code in the validators and backends fails near 250."""

REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
KNOWN_DIALECTS = {
    uri.rstrip("#"): uri
    for uri in (
        "http://json-schema.org/draft-04/schema#",
        "http://json-schema.org/draft-06/schema#",
        "http://json-schema.org/draft-07/schema#",
        "https://json-schema.org/draft/2019-09/schema",
        DRAFT_2020_12,
    )
}
"""``$schema`` values honoured (with or without a trailing ``#``); any other is Draft 2020-12."""
KIND = "json_schema"
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """The deepest bracket nesting of a JSON text, strings excluded; linear, no recursion."""
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def admit_schema(text: str, max_depth: int = DEFAULT_MAX_SCHEMA_DEPTH) -> dict[str, Any] | bool:
    """Parse and check a caller's schema text; returns the schema or raises InvalidGrammarError."""
    depth = json_depth(text)
    if depth > max_depth:
        raise InvalidGrammarError(
            KIND, f"the schema is nested {depth} levels deep, over the limit of {max_depth}"
        )
    try:  # (unbalanced brackets inside a string can fool json_depth: "nested too deeply")
        schema = json_text.loads(text)
    except json_text.JSONTextError as exc:
        raise InvalidGrammarError(
            KIND, f"schema is not valid JSON: {exc.msg}", line=exc.line, column=exc.column
        ) from exc
    if not isinstance(schema, (dict, bool)):
        raise InvalidGrammarError(
            KIND,
            f"a JSON schema must be an object or a boolean, got {type(schema).__name__}",
            pointer="",
        )
    check_schema(schema)
    return schema


def check_schema(schema: dict[str, Any] | bool) -> None:
    """Meta-schema validity, then local resolution of every ref (see the module docstring)."""
    if isinstance(schema, bool):
        return
    _check_against_metaschema(schema)
    _check_refs_are_local(schema)
    total = 0  # property names in all (point 5)
    for node in walk(schema):
        if isinstance(node.schema, dict):
            _check_patterns(node.schema, node.pointer)
            total += _name_count(node.schema, node.pointer)
    if total > MAX_NAMES:
        raise InvalidGrammarError(
            KIND, f"{total} property names in the schema: at most {MAX_NAMES}", pointer=""
        )


def _name_count(node: dict[str, Any], pointer: str) -> int:
    """The property names ``node`` lists (``properties`` and ``required`` together); refused
    past :data:`MAX_NAMES_PER_OBJECT` (module docstring, point 5)."""
    listed = node.get("properties")
    required = node.get("required")
    names = set(listed) if isinstance(listed, dict) else set()
    if isinstance(required, list):
        names.update(n for n in required if isinstance(n, str))
    if len(names) > MAX_NAMES_PER_OBJECT:
        raise InvalidGrammarError(
            KIND,
            f"{len(names)} property names (properties and required) in one object: at most "
            f"{MAX_NAMES_PER_OBJECT}",
            pointer=pointer,
        )
    return len(names)


def _check_patterns(node: dict[str, Any], pointer: str) -> None:
    """Refuse a ``pattern`` or ``patternProperties`` name of ``node`` whose counted repetitions
    ask for too many copies (``regex_dialect.too_many_copies``: the analysis and the
    post-validator compile every pattern with Python's ``regex`` module, which writes such a
    count out in full), or that module does not compile: its message and position, at the
    pattern's pointer (a backend's own error points into the grammar it wrapped the pattern
    in: ``[a-`` was "Unclosed '[' at position 18")."""
    import regex

    from espalier.constrained.regex_dialect import too_many_copies

    places = []
    if isinstance(node.get("pattern"), str):
        places.append(("pattern", node["pattern"]))
    names = node.get("patternProperties")
    if isinstance(names, dict):
        places += [(f"patternProperties/{escape_pointer_token(k)}", k) for k in names]
    for where, pattern in places:
        problem = too_many_copies(pattern)
        if problem is not None:
            raise InvalidGrammarError(KIND, f"pattern: {problem}", pointer=f"{pointer}/{where}")
        try:
            regex.compile(pattern)
        except (regex.error, OverflowError, RecursionError) as exc:
            raise InvalidGrammarError(
                KIND,
                f"pattern {pattern[:80]!r} is not a regular expression: {exc}",
                pointer=f"{pointer}/{where}",
            ) from exc


@functools.cache
def _metaschema_validator(dialect: str) -> Any:
    """A ``jsonschema_rs`` validator of the bundled meta-schema ``dialect``: offline (it never
    fetches), formats not asserted (the meta-schemas' ``format: regex`` is an annotation)."""
    import jsonschema_rs

    return jsonschema_rs.validator_for(
        METASCHEMAS.contents(dialect), validate_formats=False, offline=True
    )


def _check_against_metaschema(schema: dict[str, Any]) -> None:
    """Validate with ``jsonschema_rs``: ~600x faster than ``jsonschema`` on the 2020-12
    meta-schema (0.05 s vs 33 s for a 0.9 MB schema)."""
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        raise InvalidGrammarError(KIND, "$schema must be a string (a URI)", pointer="/$schema")
    name = KNOWN_DIALECTS.get(dialect.rstrip("#"), DRAFT_2020_12) if dialect else DRAFT_2020_12
    errors = _metaschema_validator(name).iter_errors(schema)
    first = next(errors, None)
    if first is None:
        return
    more = sum(1 for _ in itertools.islice(errors, 99))
    pointer = "".join("/" + escape_pointer_token(str(p)) for p in first.instance_path)
    others = f" (and {more}{'+' if more == 99 else ''} more)" if more else ""
    raise InvalidGrammarError(
        KIND, f"not a valid schema ({name}): {_short(first.message)}{others}", pointer=pointer
    )


def _check_refs_are_local(schema: dict[str, Any]) -> None:
    refs = [
        (node.pointer, keyword, node.schema[keyword])
        for node in walk(schema)
        if isinstance(node.schema, dict)
        for keyword in REF_KEYWORDS
        if keyword in node.schema
    ]
    if not refs:
        return
    resolvers = _resolvers_by_pointer(schema)
    for pointer, keyword, ref in refs:
        where = f"{pointer}/{keyword}"
        if not isinstance(ref, str):
            raise InvalidGrammarError(KIND, f"{keyword} must be a string", pointer=where)
        resolver = resolvers[_scope_of(pointer, resolvers)]
        try:
            resolver.lookup(ref)
        except (referencing.exceptions.Unresolvable, ValueError) as exc:
            raise InvalidGrammarError(
                KIND,
                f"{keyword} '{_short(ref, 200)}' does not resolve inside this schema; only the"
                " schema's own resources and the bundled meta-schemas are available"
                f" ({type(exc).__name__})",
                pointer=where,
            ) from exc


def _resolvers_by_pointer(schema: dict[str, Any]) -> dict[str, Any]:
    """A resolver per schema object that sets a base URI (``$id``), keyed by its pointer."""
    spec = referencing.jsonschema.specification_with(
        schema.get("$schema", ""), default=referencing.jsonschema.DRAFT202012
    )
    root = spec.create_resource(schema)
    # an empty fragment ("https://x/s.json#", common in draft 4-7) names the document itself
    root_uri = schema["$id"].rstrip("#") if isinstance(schema.get("$id"), str) else ""
    registry = LOCAL_REGISTRY.with_resource(root_uri, root)
    resolvers = {"": registry.resolver(base_uri=root_uri)}
    for node in walk(schema):
        if (
            node.pointer
            and isinstance(node.schema, dict)
            and isinstance(node.schema.get("$id"), str)
        ):
            parent = resolvers[_scope_of(node.pointer.rsplit("/", 1)[0], resolvers)]
            resolvers[node.pointer] = parent.in_subresource(spec.create_resource(node.schema))
    return resolvers


def _scope_of(pointer: str, resolvers: dict[str, Any]) -> str:
    """The pointer of the nearest enclosing schema object (itself included) that sets ``$id``."""
    while pointer not in resolvers:
        pointer = pointer.rsplit("/", 1)[0] if "/" in pointer else ""
    return pointer


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
