"""Resolve ``$ref`` before compiling, so that backends only ever see ``#/$defs/<name>`` refs.

Backends resolve local ``#/$defs/...`` pointers but not remote URIs, ``$id``-relative refs,
``$anchor``s or pointers into arbitrary places. :func:`resolve_refs` rewrites a schema into an
equivalent one where every ``$ref`` target is hoisted into the root ``$defs`` under a generated
name (one entry per distinct target, so the size stays linear and recursive schemas stay finite).
Remote documents come from a supplied :class:`referencing.Registry` — never the network; see
:func:`directory_registry` for the JSON Schema Test Suite's ``remotes/`` layout.

Semantics kept: in Draft 2019-09/2020-12 keywords next to ``$ref`` apply too (rewritten to a merge
when the two sides cannot interact, else to ``allOf``); in Draft 7 and older they are ignored.
The original ``$defs`` / ``definitions`` are dropped: every use is now a hoisted def.

``$dynamicRef`` / ``$recursiveRef`` are resolved statically: the expansion follows every ref from
the root the way evaluation does, so at each dynamic ref it knows the dynamic scope (the resources
entered on the way) and resolves the ref exactly as ``jsonschema`` would there (``referencing``'s
dynamic lookup). A target reached under a different dynamic scope is hoisted again; the scope is
keyed by what can still change a later resolution (:func:`_scope_key`), which takes finitely many
values, so recursive schemas stay finite. Past :data:`MAX_DYNAMIC_DEFS` hoisted targets the
schema comes back unchanged (and feature analysis refuses its dynamic refs).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import referencing
import referencing.exceptions
import referencing.jsonschema

from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.schema.logic import deref
from espalier.constrained.schema.walk import DRAFT_7, dialect_of, map_subschemas, walk

# Keywords that read their siblings in the same schema object: merging a $ref target into its
# referring object is only exact when no group is present on both sides.
INTERACTING = (
    frozenset({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"}),
    frozenset(
        {
            "prefixItems",
            "items",
            "additionalItems",
            "unevaluatedItems",
            "contains",
            "minContains",
            "maxContains",
        }
    ),
    frozenset({"if", "then", "else"}),
)
IDENTIFIERS = frozenset({"$id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$schema"})
REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")
DEFS_NAME_PREFIX = "ref"
MAX_DYNAMIC_DEFS = 512
"""Hoisted targets allowed when dynamic scopes multiply them (one per scope that reaches them)."""
MAX_DYNAMIC_COPY_BYTES = 8 << 20
"""Hoisted targets times the schema's JSON size stays below this: each copy is at most the
schema, so a large schema gets fewer scopes (a 1 MB one: 8) and the expansion stays bounded."""


class _TooManyScopes(Exception):
    """The dynamic expansion passed :data:`MAX_DYNAMIC_DEFS`."""


@dataclass(frozen=True)
class ResolvedSchema:
    """A schema whose refs are all ``#/$defs/<name>``; ``recursive``: some def reaches itself.

    A schema whose dynamic refs need more than :data:`MAX_DYNAMIC_DEFS` hoisted targets comes
    back unchanged.
    """

    schema: dict[str, Any] | bool
    recursive: bool
    hoisted: int
    origins: tuple[tuple[str, str], ...] = ()  # (hoisted def name, the $ref it came from)

    def display_pointer(self, pointer: str) -> str:
        """Map a pointer into a hoisted def back to the ref target it came from."""
        for name, ref in self.origins:
            prefix = f"/$defs/{name}"
            if pointer == prefix or pointer.startswith(prefix + "/"):
                target = ref[1:] if ref.startswith("#") else ref
                return target + pointer[len(prefix) :]
        return pointer


def directory_registry(
    root: str | Path, base_uri: str = "http://localhost:1234/"
) -> referencing.Registry[Any]:
    """A registry serving every ``*.json`` under ``root`` at ``base_uri + relative path``."""
    root = Path(root)
    resources = []
    for path in sorted(root.rglob("*.json")):
        contents = json.loads(path.read_text(encoding="utf-8"))
        uri = base_uri + path.relative_to(root).as_posix()
        resource = referencing.Resource.from_contents(
            contents, default_specification=referencing.jsonschema.DRAFT202012
        )
        resources.append((uri, resource))
    registry: referencing.Registry[Any] = referencing.Registry().with_resources(resources)
    return registry


def resolve_refs(
    schema: dict[str, Any] | bool,
    registry: referencing.Registry[Any] | None = None,
    max_dynamic_defs: int = MAX_DYNAMIC_DEFS,
) -> ResolvedSchema:
    """Rewrite ``schema`` so that each ``$ref`` is a ``#/$defs/<name>`` of the returned root.

    Raises InvalidGrammarError (with the JSON pointer of the ``$ref``) for refs that cannot be
    resolved: unknown remote URIs, bad pointers.
    """
    if isinstance(schema, bool) or not _has_ref(schema):
        return ResolvedSchema(schema, recursive=False, hoisted=0)
    resolver = _root_resolver(schema, registry)
    dynamic = _is_dynamic(schema)
    if dynamic:
        size = len(json.dumps(schema))
        max_dynamic_defs = min(max_dynamic_defs, MAX_DYNAMIC_COPY_BYTES // max(size, 1))
    state = _State(dialect_of(schema) == DRAFT_7, dynamic, max_dynamic_defs, _specification(schema))
    try:
        body = state.expand(schema, resolver, "", entered=True)
    except _TooManyScopes:
        return ResolvedSchema(schema, recursive=False, hoisted=0)
    if not isinstance(body, dict):  # the root was a ref to a boolean schema
        return ResolvedSchema(body, recursive=False, hoisted=0)
    body = {k: v for k, v in body.items() if k not in ("$defs", "definitions")}
    defs = dict(state.defs)
    if defs:
        body["$defs"] = defs
    if state.dynamic:  # scopes hoist copies for the unused $defs entries' scopes too
        body = prune_unused_defs(body)
        defs = body.get("$defs", {})
    if isinstance(schema, dict) and "$schema" in schema:
        body["$schema"] = schema["$schema"]
    if _is_dynamic(body):  # e.g. a metaschema reached through a ref
        return ResolvedSchema(schema, recursive=False, hoisted=0)
    origins = tuple((name, ref) for name, ref in state.origins.items())
    return ResolvedSchema(body, state.recursive, len(defs), origins)


def _has_ref(schema: Any) -> bool:
    text = json.dumps(schema)
    return any(f'"{k}"' in text for k in REFERENCES)


def _is_dynamic(schema: Any) -> bool:
    """Whether resolving a ref can depend on the evaluation path (dynamic scope)."""
    text = json.dumps(schema)
    return any(f'"{k}"' in text for k in ("$dynamicRef", "$recursiveRef", "$dynamicAnchor"))


def _specification(schema: Any) -> referencing.Specification[Any]:
    """The draft ``schema``'s ``$schema`` names (draft-04's ``id`` included), else 2020-12."""
    default = referencing.jsonschema.specification_with(
        dialect_of(schema), default=referencing.jsonschema.DRAFT202012
    )
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    return referencing.jsonschema.specification_with(uri, default=default) if uri else default


def _root_resolver(
    schema: dict[str, Any], registry: referencing.Registry[Any] | None
) -> referencing._core.Resolver[Any]:
    from jsonschema_specifications import REGISTRY as METASCHEMAS

    resource = _specification(schema).create_resource(schema)
    base = registry.combine(METASCHEMAS) if registry is not None else METASCHEMAS
    # an empty fragment ("...json#", common in draft-04/06 ids) names the document itself: the
    # registry stores it without the '#', so the base URI must drop it too
    root_uri = (resource.id() or "").rstrip("#")
    reg = base.with_resource(root_uri, resource)
    return reg.resolver(base_uri=root_uri)


class _State:
    def __init__(
        self,
        legacy: bool,
        dynamic: bool = False,
        max_defs: int = 0,
        spec: referencing.Specification[Any] = referencing.jsonschema.DRAFT202012,
    ) -> None:
        self.legacy = legacy
        self.spec = spec  # the root's draft: how its subschemas spell their ids
        self.dynamic = dynamic  # key hoisted targets by dynamic scope too
        self.max_defs = max_defs  # when dynamic
        self.defs: dict[str, Any] = {}
        # (base uri, id(target contents), dynamic scope key) -> def name
        self.names: dict[tuple[str, int, tuple[Any, ...]], str] = {}
        self.recursive = False
        self.origins: dict[str, str] = {}
        self._in_progress: set[str] = set()

    def expand(self, node: Any, resolver: Any, pointer: str, entered: bool = False) -> Any:
        """Expand one schema object; ``entered``: ``resolver`` is already at this node's ``$id``."""
        if not isinstance(node, dict):
            return node
        # the root's draft decides: in Draft 7 and older an $id next to $ref is ignored like
        # every other sibling, and an $id of '#name' is an anchor, not a new base URI
        uri = None if entered else self.spec.id_of(node)
        if isinstance(uri, str) and uri.rstrip("#"):  # '...json#' is the document itself
            base = referencing.jsonschema.DRAFT202012.create_resource({"$id": uri.rstrip("#")})
            resolver = resolver.in_subresource(base)
        out = map_subschemas(node, pointer, lambda sub, at: self.expand(sub, resolver, at))
        for key in IDENTIFIERS:
            out.pop(key, None)
        if self.spec is referencing.jsonschema.DRAFT4 and isinstance(node.get("id"), str):
            out.pop("id")  # draft-04's $id
        names = [
            self._hoist(keyword, node[keyword], resolver, pointer)
            for keyword in REFERENCES
            if isinstance(node.get(keyword), str)
        ]
        if not names:
            return out
        siblings = {k: v for k, v in out.items() if k not in REFERENCES}
        siblings.pop("$defs", None)
        siblings.pop("definitions", None)
        target = self.defs.get(names[0])
        if len(names) == 1 and isinstance(target, bool) and names[0] not in self._in_progress:
            # a boolean target is the value itself ("true" adds nothing to the siblings)
            return target if target is False or self.legacy or not siblings else siblings
        references = [{"$ref": f"#/$defs/{name}"} for name in names]
        if len(references) == 1 and (self.legacy or not siblings):
            return references[0]
        if len(names) == 1 and isinstance(target, dict) and _mergeable(target, siblings):
            return {**target, **siblings}
        # $ref is an in-place applicator, like one more allOf branch: siblings stay where they
        # are, so unevaluated* keep seeing what the ref evaluates.
        return {**siblings, "allOf": [*references, *siblings.get("allOf", [])]}

    def _hoist(self, keyword: str, ref: str, resolver: Any, pointer: str) -> str:
        try:
            if keyword == "$recursiveRef":
                resolved = referencing.jsonschema.lookup_recursive_ref(resolver)
            else:  # $dynamicRef: referencing resolves dynamic anchors in the resolver's scope
                resolved = resolver.lookup(ref)
        except referencing.exceptions.Unresolvable as exc:
            raise InvalidGrammarError(
                "json_schema",
                f"cannot resolve {keyword} '{ref}' ({type(exc).__name__}); remote refs resolve"
                " only from a supplied registry",
                pointer=f"{pointer}/{keyword}",
            ) from exc
        contents = resolved.contents
        scope = _scope_key(resolved.resolver) if self.dynamic else ()
        key = (str(getattr(resolved.resolver, "_base_uri", "")), id(contents), scope)
        name = self.names.get(key)
        if name is not None:
            if name in self._in_progress:
                self.recursive = True
            return name
        if self.dynamic and len(self.names) >= self.max_defs:
            raise _TooManyScopes
        name = _def_name(ref, len(self.names))
        self.names[key] = name
        self.origins[name] = ref
        self._in_progress.add(name)
        self.defs[name] = True  # placeholder while expanding (recursion sees the name)
        self.defs[name] = self.expand(contents, resolved.resolver, f"{pointer}/$ref", entered=True)
        self._in_progress.discard(name)
        return name


DEFS_PREFIX = "#/$defs/"


def prune_unused_defs(schema: Any) -> Any:
    """``schema`` without the root ``$defs`` entries no ref reaches from outside ``$defs``
    (directly or through other entries); unchanged when a ref of another form (an anchor, a
    URI, ``#`` or a pointer elsewhere) could reach an entry in a way not followed here."""
    if not isinstance(schema, dict) or not isinstance(schema.get("$defs"), dict):
        return schema
    defs: dict[str, Any] = schema["$defs"]
    body = {k: v for k, v in schema.items() if k != "$defs"}
    targets = _def_targets(body)
    if targets is None:
        return schema
    seen: set[str] = set()
    todo = list(targets)
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        more = _def_targets(defs[name])
        if more is None:
            return schema
        todo.extend(more)
    kept = {name: sub for name, sub in defs.items() if name in seen}
    return {**body, "$defs": kept} if kept else body


def inline_boolean_refs(schema: Any) -> Any:
    """``schema`` with each lone ``{"$ref": "#/$defs/x"}`` whose target is ``true`` / ``false``
    replaced by that boolean (llguidance refuses a ref to ``false``: "schema is false")."""
    if not isinstance(schema, dict) or not isinstance(schema.get("$defs"), dict):
        return schema
    defs: dict[str, Any] = schema["$defs"]

    def inline(node: Any, pointer: str) -> Any:
        target = deref(node, defs)
        if isinstance(target, bool) and target is not node:
            return target
        return map_subschemas(node, pointer, inline) if isinstance(node, dict) else node

    return inline(schema, "")


def _def_targets(node: Any) -> set[str] | None:
    """The ``$defs`` entry names of every ref under ``node``; None if a ref is of another form."""
    names: set[str] = set()
    for item in walk(node):
        if not isinstance(item.schema, dict):
            continue
        for keyword in REFERENCES:
            ref = item.schema.get(keyword)
            if keyword not in item.schema:
                continue
            if not isinstance(ref, str) or not ref.startswith(DEFS_PREFIX):
                return None
            token = ref[len(DEFS_PREFIX) :].split("/", 1)[0]
            names.add(token.replace("~1", "/").replace("~0", "~"))
    return names


def _scope_key(resolver: Any) -> tuple[Any, ...]:
    """What of ``resolver``'s dynamic scope can still decide a later dynamic ref below it.

    A ``$dynamicRef`` takes the outermost resource of the scope that has the anchor, so only the
    first (outermost) occurrence of each URI counts: the URIs in that order. A ``$recursiveRef``
    walks the scope from the innermost resource while each has ``$recursiveAnchor: true``: the
    last resource of that run counts (None when the innermost has none). The scope only grows at
    the inner end, so these two values decide every later resolution.
    """
    inner_first = [uri for uri, _ in resolver.dynamic_scope()]
    outermost: dict[str, None] = {}
    for uri in reversed(inner_first):
        outermost.setdefault(uri, None)
    run_end = None
    for uri in inner_first:
        try:
            contents = resolver.lookup(uri).contents
        except referencing.exceptions.Unresolvable:
            break
        if not isinstance(contents, dict) or contents.get("$recursiveAnchor") is not True:
            break
        run_end = uri
    return (tuple(outermost), run_end)


def _def_name(ref: str, index: int) -> str:
    tail = re.sub(r"[^A-Za-z0-9_]+", "_", ref.rsplit("/", 1)[-1])[:40].strip("_")
    return f"{DEFS_NAME_PREFIX}{index}_{tail}" if tail else f"{DEFS_NAME_PREFIX}{index}"


def _mergeable(target: dict[str, Any], siblings: dict[str, Any]) -> bool:
    if "$ref" in target or set(target) & set(siblings):
        return False
    return not any(group & set(target) and group & set(siblings) for group in INTERACTING)
