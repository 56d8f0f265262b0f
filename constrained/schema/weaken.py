"""The schema a backend compiles under ``allow_weakening``: without what it would refuse.

Strict compiles (the default) refuse a schema with a keyword use the backend does not enforce;
``allow_weakening=True`` takes the backend with the fewest such uses and reports each one in
``CompileReport.weakened``. A backend that *refuses* some of them at compile (llguidance:
"Unimplemented keys" for ``uniqueItems``, ``contains``, ``not``, ...; "Unknown format" for
``iri``; overlapping ``oneOf`` branches) would then refuse the schema anyway, and the compile
would fall through to a backend with more issues. :func:`weakened_schema` drops those uses and
reads a refused ``oneOf`` as ``anyOf`` (at least one branch instead of exactly one), so that the
backend generates without them. None of them is exact in the backend's profile
(:data:`features.PROFILES`), so :func:`features.backend_issues` reports every one.
"""

from __future__ import annotations

from typing import Any

from espalier.constrained.schema.features import PROFILES, BackendProfile
from espalier.constrained.schema.walk import map_subschemas


def weakened_schema(backend: str, schema: Any) -> Any:
    """``schema`` without the keyword uses ``backend`` refuses at compile; ``schema`` itself
    (the same object) when it has none."""
    profile = PROFILES[backend]
    weakened = _visit(profile, schema, "")
    return schema if weakened == schema else weakened


def _visit(profile: BackendProfile, node: Any, pointer: str) -> Any:
    if not isinstance(node, dict):
        return node

    def child(sub: Any, at: str) -> Any:
        keyword = at[len(pointer) + 1 :].split("/", 1)[0]
        if sub is False and not profile.false_schema and keyword not in profile.false_schema_under:
            return True  # a ``false`` it refuses at compile: reported ignored, so dropped
        return _visit(profile, sub, at)

    out = map_subschemas(node, pointer, child)
    dropped = profile.refused & out.keys()
    if profile.uncompilable is not None:
        dropped |= profile.uncompilable(out)
    for keyword in dropped:
        del out[keyword]
    formats = profile.compiled_formats
    if formats is not None and "format" in out and out["format"] not in formats:
        del out["format"]
    if profile.one_of_refused and isinstance(out.get("oneOf"), list):
        if "anyOf" not in out:
            out["anyOf"] = out.pop("oneOf")
        elif isinstance(out.get("allOf", []), list):  # both: each must hold
            out["allOf"] = [*out.get("allOf", []), {"anyOf": out.pop("oneOf")}]
    return out
