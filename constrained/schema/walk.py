"""Where JSON Schema keeps subschemas, and a walk over every schema object with its JSON pointer.

Only keywords listed here are descended into: a ``$ref`` or ``$id`` inside ``const``, ``enum``,
``default``, ``examples`` or an unknown keyword is data, not schema, and is left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# keyword -> how its value holds subschemas
SINGLE = frozenset(
    {
        "additionalProperties",
        "additionalItems",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
        "unevaluatedItems",
        "unevaluatedProperties",
        "contentSchema",
    }
)
LISTED = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})

DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
DRAFT_2019_09 = "https://json-schema.org/draft/2019-09/schema"
DRAFT_7 = "http://json-schema.org/draft-07/schema#"


def escape_pointer_token(token: str) -> str:
    """RFC 6901 escaping of one reference token."""
    return token.replace("~", "~0").replace("/", "~1")


@dataclass(frozen=True)
class SchemaNode:
    """One schema object (dict or bool) met in a walk, at JSON pointer ``pointer``."""

    pointer: str
    schema: dict[str, Any] | bool


def child_schemas(schema: dict[str, Any], pointer: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(pointer, subschema)`` for every direct subschema of one schema object."""
    for key, value in schema.items():
        at = f"{pointer}/{escape_pointer_token(key)}"
        if key in SINGLE:
            yield at, value
        elif key in LISTED and isinstance(value, list):
            for i, sub in enumerate(value):
                yield f"{at}/{i}", sub
        elif key in NAMED and isinstance(value, dict):
            for name, sub in value.items():
                yield f"{at}/{escape_pointer_token(name)}", sub
        elif key == "items":
            if isinstance(value, list):
                for i, sub in enumerate(value):
                    yield f"{at}/{i}", sub
            else:
                yield at, value
        elif key == "dependencies" and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, (dict, bool)):
                    yield f"{at}/{escape_pointer_token(name)}", sub


def walk(schema: Any, pointer: str = "") -> Iterator[SchemaNode]:
    """Every schema object reachable through schema keywords, parents before children."""
    stack: list[tuple[str, Any]] = [(pointer, schema)]
    while stack:
        at, node = stack.pop()
        if isinstance(node, bool):
            yield SchemaNode(at, node)
        elif isinstance(node, dict):
            yield SchemaNode(at, node)
            stack.extend(reversed(list(child_schemas(node, at))))


def map_subschemas(schema: dict[str, Any], pointer: str, fn: Any) -> dict[str, Any]:
    """A shallow copy of ``schema`` with every direct subschema replaced by ``fn(sub, pointer)``."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        at = f"{pointer}/{escape_pointer_token(key)}"
        if key in SINGLE:
            out[key] = fn(value, at)
        elif key in LISTED and isinstance(value, list):
            out[key] = [fn(sub, f"{at}/{i}") for i, sub in enumerate(value)]
        elif key in NAMED and isinstance(value, dict):
            out[key] = {n: fn(s, f"{at}/{escape_pointer_token(n)}") for n, s in value.items()}
        elif key == "items":
            if isinstance(value, list):
                out[key] = [fn(sub, f"{at}/{i}") for i, sub in enumerate(value)]
            else:
                out[key] = fn(value, at)
        elif key == "dependencies" and isinstance(value, dict):
            out[key] = {
                n: fn(s, f"{at}/{escape_pointer_token(n)}") if isinstance(s, (dict, bool)) else s
                for n, s in value.items()
            }
        else:
            out[key] = value
    return out


def dialect_of(schema: Any) -> str:
    """The ``$schema`` URI of a root schema, normalised; Draft 2020-12 when absent or unknown."""
    if isinstance(schema, dict):
        uri = schema.get("$schema")
        if isinstance(uri, str):
            bare = uri.rstrip("#")
            if "draft-07" in bare or "draft-06" in bare or "draft-04" in bare:
                return DRAFT_7
            if "2019-09" in bare:
                return DRAFT_2019_09
    return DRAFT_2020_12
