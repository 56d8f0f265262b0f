"""Where an instance's arrays must hold distinct items: ``uniqueItems`` as an automaton of places.

A grammar cannot say "unlike every earlier item", so ``uniqueItems: true`` over an open item
domain is enforced at run time by the key tracker (``constrained/keys``: a JSON lexer over the
accepted bytes). The lexer does not know the schema; this module gives it :class:`Places`, a
small deterministic automaton over an instance's places: the root is state 0, an object key
(a table of names, a default for the others) or an array position (``prefixItems`` index, then
``items``) moves to another state, -1 when nothing below is tracked, and each state says whether
an array there must have unique items.

A state is the set of schema objects that all apply to the value there (``$ref`` and ``allOf``
added in; an ``anyOf`` / ``oneOf`` added in only where one branch alone admits the value's kind;
objects that hold no ``uniqueItems`` at or below them left out). :func:`mark_unique_items`
accepts a schema only when each place has one answer and every unique array's items are scalars
of an open domain; otherwise it leaves ``uniqueItems`` for the backends' profiles to refuse (as
before, naming keyword and pointer). Refused: a ``uniqueItems`` reached through ``not``, ``if``,
``then`` / ``else``, ``contains``, ``propertyNames``, ``dependentSchemas`` / ``dependencies``,
``unevaluatedItems`` / ``unevaluatedProperties`` or ``patternProperties`` (no one answer per
place); an ``anyOf`` / ``oneOf`` where several branches admit the kind and one holds
``uniqueItems`` below; items that may be objects or arrays; finite item domains (``enum`` /
``const``, only booleans and null, a narrow integer range: the tracker would leave the model a
dead end once every member is taken); more than :data:`MAX_STATES` states.

An accepted schema's ``uniqueItems: true`` become :data:`MARK` (a key the backends ignore and
never refuse); :func:`unique_places` reads the marks back into :class:`Places`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from espalier.constrained.schema.logic import DEFS_PREFIX, type_list
from espalier.constrained.schema.value_complement import json_type
from espalier.constrained.schema.walk import child_schemas, map_subschemas

MARK = "x-espalier-uniqueItems"
"""The key that stands for an accepted ``uniqueItems: true`` in the schema the backends see."""
MAX_STATES = 256
MIN_OPEN_INTEGERS = 256  # an integer item range narrower than this counts as a finite domain
BRANCHING = ("anyOf", "oneOf")
CONDITIONAL = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "dependentSchemas",
    "dependencies",
    "unevaluatedItems",
    "unevaluatedProperties",
    "patternProperties",
    "additionalItems",
)


@dataclass(frozen=True)
class Places:
    """The automaton (module docstring). Per state ``s``: ``unique[s]``; ``keys[s]``: (name as
    UTF-8, target) pairs, ``key_default[s]`` for other names; ``prefix[s]``: the targets of
    item positions 0, 1, ..., ``item_default[s]`` for later ones. Targets are states or -1.
    ``item_chars[s]``: where ``unique[s]``, the most characters a string item after the prefix
    has (:func:`_longest_string`; -1: none kept): the tracker refuses a token that leaves such an
    item at that length equal to an earlier item, the one way on being a duplicate.
    ``item_words[s]``: where ``unique[s]``, every string a string item after the prefix may be
    (:func:`_string_words`, a superset of its language; None: none kept): the tracker refuses a
    token after which every listed word that extends the item so far is an earlier item."""

    unique: tuple[bool, ...]
    keys: tuple[tuple[tuple[bytes, int], ...], ...]
    key_default: tuple[int, ...]
    prefix: tuple[tuple[int, ...], ...]
    item_default: tuple[int, ...]
    item_chars: tuple[int, ...]
    item_words: tuple[tuple[str, ...] | None, ...]


class _Refused(Exception):
    pass


def mark_unique_items(schema: Any) -> Any:
    """``schema`` (prepared: refs resolved to ``#/$defs/...``, rewritten) with every
    ``uniqueItems: true`` replaced by :data:`MARK` when :class:`Places` can follow them all
    (module docstring), else ``schema`` unchanged. Marks already in ``schema`` are dropped
    first: only this function places them."""
    if any(True for _ in _nodes_with(schema, MARK)):
        schema = _strip(schema, MARK)
    if not any(True for _ in _nodes_with(schema, "uniqueItems")):
        return schema
    try:
        _Analysis(schema, "uniqueItems").places()
    except _Refused:
        return schema
    return _rename(schema, "uniqueItems", MARK)


def unique_places(schema: Any) -> Places | None:
    """The :class:`Places` of a schema marked by :func:`mark_unique_items`; None when it holds
    no mark (nothing to track)."""
    if not any(True for _ in _nodes_with(schema, MARK)):
        return None
    try:
        return _Analysis(schema, MARK).places()
    except _Refused:  # a marked schema was accepted once: only a tampered one lands here
        return None


def _nodes_with(schema: Any, word: str) -> Iterator[dict[str, Any]]:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get(word) is True:
                yield node
            stack.extend(sub for _, sub in child_schemas(node, ""))


def _strip(schema: Any, word: str) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, "", lambda sub, _at: _strip(sub, word))
    out.pop(word, None)
    return out


def _rename(schema: Any, old: str, new: str) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, "", lambda sub, _at: _rename(sub, old, new))
    if out.get(old) is True:
        del out[old]
        out[new] = True
    return out


class _Analysis:
    def __init__(self, schema: Any, word: str) -> None:
        self.root = schema
        self.word = word
        self.defs = schema.get("$defs", {}) if isinstance(schema, dict) else {}
        self.nodes: dict[int, Any] = {}
        self.reach = self._reaching()

    # -- the schema graph ------------------------------------------------------------------

    def _target(self, node: dict[str, Any]) -> Any:
        ref = node.get("$ref")
        if ref is None:
            return None
        if not isinstance(ref, str) or not ref.startswith(DEFS_PREFIX):
            raise _Refused
        name = ref[len(DEFS_PREFIX) :]
        if "/" in name or name not in self.defs:
            raise _Refused
        return self.defs[name]

    def _children(self, node: dict[str, Any]) -> list[Any]:
        kids = [sub for key, sub in child_schemas(node, "") if not key.startswith("/$defs/")]
        target = self._target(node)
        if target is not None:
            kids.append(target)
        return kids

    def _reaching(self) -> set[int]:
        """ids of the schema objects with ``word`` at or below them."""
        parents: dict[int, list[int]] = {}
        seen: set[int] = set()
        stack = [self.root]
        marked: list[int] = []
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            if "$dynamicRef" in node or "$recursiveRef" in node:
                raise _Refused  # a target this graph does not follow
            seen.add(id(node))
            self.nodes[id(node)] = node
            if node.get(self.word) is True:
                marked.append(id(node))
            for kid in self._children(node):
                if isinstance(kid, dict):
                    parents.setdefault(id(kid), []).append(id(node))
                    stack.append(kid)
        reach = set(marked)
        queue = deque(marked)
        while queue:
            for parent in parents.get(queue.popleft(), []):
                if parent not in reach:
                    reach.add(parent)
                    queue.append(parent)
        return reach

    def _reaches(self, node: Any) -> bool:
        return isinstance(node, dict) and id(node) in self.reach

    def _admits(self, node: Any, kind: str, depth: int = 0) -> bool:
        """Whether ``node`` may admit a value of JSON type ``kind`` (True when unsure)."""
        if node is False:
            return False
        if not isinstance(node, dict) or depth > 16:
            return True
        kinds = node.get("type")
        if isinstance(kinds, str):
            kinds = [kinds]
        if isinstance(kinds, list) and kind not in kinds:
            return False
        if "const" in node and json_type(node["const"]) != kind:
            return False
        values = node.get("enum")
        if isinstance(values, list) and all(json_type(v) != kind for v in values):
            return False
        target = self._target(node)
        if target is not None and not self._admits(target, kind, depth + 1):
            return False
        parts = node.get("allOf")
        if isinstance(parts, list) and not all(self._admits(p, kind, depth + 1) for p in parts):
            return False
        for word in BRANCHING:
            branches = node.get(word)
            if isinstance(branches, list) and not any(
                self._admits(b, kind, depth + 1) for b in branches
            ):
                return False
        return True

    # -- places ----------------------------------------------------------------------------

    def _expand(self, base: frozenset[int], kind: str) -> list[dict[str, Any]]:
        """The schema objects that all apply to a value of ``kind`` at a place (module
        docstring); raises :class:`_Refused` where the place has no one answer."""
        if not all(self._admits(n, kind) for n in self._conjuncts([self.nodes[i] for i in base])):
            return []  # no value of this kind here: nothing to follow
        out: dict[int, dict[str, Any]] = {}
        stack = [self.nodes[i] for i in base]
        while stack:
            node = stack.pop()
            if not self._reaches(node) or id(node) in out:
                continue
            out[id(node)] = node
            if any(self._reaches_in(node.get(word)) for word in CONDITIONAL):
                raise _Refused
            target = self._target(node)
            if target is not None:
                stack.append(target)
            parts = node.get("allOf")
            if isinstance(parts, list):
                stack.extend(parts)
            for word in BRANCHING:
                branches = node.get(word)
                if not isinstance(branches, list) or not any(map(self._reaches, branches)):
                    continue
                taking = [b for b in branches if self._admits(b, kind)]
                if len(taking) > 1 and any(map(self._reaches, taking)):
                    raise _Refused
                stack.extend(taking)
        return list(out.values())

    def _reaches_in(self, value: Any) -> bool:
        if isinstance(value, dict):
            return self._reaches(value) or any(
                self._reaches(v) for v in value.values() if isinstance(v, dict)
            )
        if isinstance(value, list):
            return any(self._reaches(v) for v in value)
        return False

    def _state(self, subs: list[Any], table: dict[frozenset[int], int], todo: deque[Any]) -> int:
        key = frozenset(id(s) for s in subs if self._reaches(s))
        if not key:
            return -1
        if key not in table:
            if len(table) >= MAX_STATES:
                raise _Refused
            table[key] = len(table)
            todo.append(key)
        return table[key]

    def places(self) -> Places:
        table: dict[frozenset[int], int] = {}
        todo: deque[frozenset[int]] = deque()
        if self._state([self.root], table, todo) < 0:
            raise _Refused
        rows: dict[int, tuple[Any, ...]] = {}
        while todo:
            base = todo.popleft()
            arrays = self._expand(base, "array")
            unique = any(n.get(self.word) is True for n in arrays)
            prefix_len = max((len(_prefix(n)) for n in arrays), default=0)
            prefix = tuple(
                self._state([_item(n, i) for n in arrays], table, todo) for i in range(prefix_len)
            )
            rest = self._state([_item(n, prefix_len) for n in arrays], table, todo)
            chars, words = -1, None
            if unique:
                self._check_items(arrays, prefix_len)
                closure = self._conjuncts([_item(n, prefix_len) for n in arrays])
                chars, words = _longest_string(closure), _string_words(closure)
            objects = self._expand(base, "object")
            if any(
                n.get("patternProperties") and self._reaches(n.get("additionalProperties"))
                for n in objects
            ):
                raise _Refused  # which keys are additional depends on patterns
            names = sorted(
                {k for n in objects for k in _properties(n)},
            )
            keys = []
            for name in names:
                subs = [_properties(n).get(name, n.get("additionalProperties")) for n in objects]
                target = self._state(subs, table, todo)
                keys.append((name.encode("utf-8", "surrogatepass"), target))
            default = self._state([n.get("additionalProperties") for n in objects], table, todo)
            keys = [(name, target) for name, target in keys if target != default]
            rows[table[base]] = (unique, tuple(keys), default, prefix, rest, chars, words)
        ordered = [rows[s] for s in range(len(table))]
        return Places(
            unique=tuple(r[0] for r in ordered),
            keys=tuple(r[1] for r in ordered),
            key_default=tuple(r[2] for r in ordered),
            prefix=tuple(r[3] for r in ordered),
            item_default=tuple(r[4] for r in ordered),
            item_chars=tuple(r[5] for r in ordered),
            item_words=tuple(r[6] for r in ordered),
        )

    def _check_items(self, arrays: list[dict[str, Any]], prefix_len: int) -> None:
        """Refuse a unique array whose items may be containers or come from a finite domain
        (except strings from a short list after the prefix: :func:`_listed`)."""
        for i in range(prefix_len + 1):
            subs = [_item(n, i) for n in arrays]
            closure = self._conjuncts(subs)
            if any(s is False for s in closure):
                continue  # no item here
            for kind in ("object", "array"):
                if all(self._admits(s, kind) for s in closure):
                    raise _Refused
            if _finite(closure) and not (i == prefix_len and _listed_words(closure)):
                # numbers, literals, prefix items: an item's last ways on are not watched
                raise _Refused

    def _conjuncts(self, subs: list[Any]) -> list[Any]:
        out: list[Any] = []
        seen: set[int] = set()
        stack = list(subs)
        while stack:
            node = stack.pop()
            if not isinstance(node, dict):
                out.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            out.append(node)
            target = self._target(node)
            if target is not None:
                stack.append(target)
            if isinstance(node.get("allOf"), list):
                stack.extend(node["allOf"])
        return out


def _prefix(node: dict[str, Any]) -> list[Any]:
    prefix = node.get("prefixItems")
    if isinstance(prefix, list):
        return prefix
    items = node.get("items")
    return items if isinstance(items, list) else []


def _item(node: dict[str, Any], index: int) -> Any:
    prefix = _prefix(node)
    if index < len(prefix):
        return prefix[index]
    items = node.get("items")
    if isinstance(items, list):
        return node.get("additionalItems", True)
    return True if items is None else items


def _properties(node: dict[str, Any]) -> dict[str, Any]:
    props = node.get("properties")
    return props if isinstance(props, dict) else {}


def _finite(closure: list[Any]) -> bool:
    """Whether the items' domain is finite (or narrow) by a keyword this can see."""
    for node in closure:
        if not isinstance(node, dict):
            continue
        if "enum" in node or "const" in node:
            return True
        kinds = node.get("type")
        if isinstance(kinds, str):
            kinds = [kinds]
        if isinstance(kinds, list) and set(kinds) <= {"boolean", "null"}:
            return True
        if kinds == ["integer"]:
            low = node.get("minimum", node.get("exclusiveMinimum"))
            high = node.get("maximum", node.get("exclusiveMaximum"))
            if (
                isinstance(low, (int, float))
                and isinstance(high, (int, float))
                and high - low < MIN_OPEN_INTEGERS
            ):
                return True
    return False


MAX_ITEM_CHARS = 64
"""The longest item bound :func:`_longest_string` keeps: the tracker counts an item's characters
at each token inside it, and past this length a repeat of a whole item is unlikely."""
FIXED_FORMATS = {"date": 10, "uuid": 36}


def _longest_string(closure: list[Any]) -> int:
    """The most characters a string matching every schema of ``closure`` (an item's conjuncts)
    has, by ``maxLength``, a fixed-length ``format`` or a ``pattern`` of bounded strings;
    -1 when none bounds it or the bound passes :data:`MAX_ITEM_CHARS`."""
    from espalier.constrained.schema.regular import pattern_longest

    bounds = []
    for node in closure:
        if not isinstance(node, dict):
            continue
        most = node.get("maxLength")
        if isinstance(most, int) and not isinstance(most, bool) and most >= 0:
            bounds.append(most)
        if node.get("format") in FIXED_FORMATS:
            bounds.append(FIXED_FORMATS[node["format"]])
        if isinstance(node.get("pattern"), str):
            longest = pattern_longest(node["pattern"], MAX_ITEM_CHARS + 1)
            if longest is not None:
                bounds.append(longest)
    most = min(bounds, default=-1)
    return most if most <= MAX_ITEM_CHARS else -1


MAX_ITEM_WORDS = 4096
"""The most words :func:`_string_words` lists. The tracker finds the words an item's text
starts by binary search and counts the array's items among them (``keys.c``), so a list costs
its logarithm per token; the bound keeps admission's listing and the place table small."""


def _string_words(closure: list[Any]) -> tuple[str, ...] | None:
    """Every string that matches all of ``closure`` (an item's conjuncts) as a backend may read
    them, when an ``enum`` / ``const`` or a ``pattern`` among them, within the ``minLength`` /
    ``maxLength`` bounds among them, allows fewer than :data:`MAX_ITEM_WORDS` strings (a
    pattern under each reading of its classes); None otherwise (and when none is left). A
    superset of the item's strings: other keywords only narrow it, and the union of the two
    readings covers a backend that reads a class either way."""
    from espalier.constrained.schema.regular import pattern_words

    low, high = 0, None
    for node in closure:
        if not isinstance(node, dict):
            continue
        shortest, longest = node.get("minLength"), node.get("maxLength")
        if isinstance(shortest, int) and not isinstance(shortest, bool):
            low = max(low, shortest)
        if isinstance(longest, int) and not isinstance(longest, bool):
            high = longest if high is None else min(high, longest)

    def fits(words: set[str]) -> set[str]:
        return {w for w in words if low <= len(w) and (high is None or len(w) <= high)}

    found: set[str] | None = None
    for node in closure:
        listed = _listed_values(node)
        if listed is not None:
            strings = {v for v in listed if isinstance(v, str)}
            if any(_surrogate(v) for v in strings):
                return None  # the tracker compares UTF-8: a lone surrogate has none
            found = fits(strings) if found is None else found & fits(strings)
        for union in _branch_words(node):  # anyOf / oneOf: a string matches some branch
            found = fits(union) if found is None else found & fits(union)
        pattern = node.get("pattern") if isinstance(node, dict) else None
        if not isinstance(pattern, str):
            continue
        words: set[str] = set()
        for reading in (False, True):
            read = pattern_words(pattern, MAX_ITEM_WORDS, (reading,), (low, high))
            if read is None:
                break
            words.update(read)
        else:
            found = words if found is None else found & words
    if found is None or not 0 < len(found) < MAX_ITEM_WORDS:
        return None
    return tuple(sorted(found))


def _only_strings(closure: list[Any]) -> bool:
    """Whether some schema of ``closure`` (an item's conjuncts) admits strings alone (an
    ``anyOf`` / ``oneOf`` of such schemas too)."""
    for node in closure:
        listed = _listed_values(node)
        if listed is not None and all(isinstance(v, str) for v in listed):
            return True
        if isinstance(node, dict) and node.get("type") in ("string", ["string"]):
            return True
        for key in ("anyOf", "oneOf"):
            branches = node.get(key) if isinstance(node, dict) else None
            if isinstance(branches, list) and branches:
                plain = [_plain_closure(b) for b in branches]
                if all(c is not None and (c == [False] or _only_strings(c)) for c in plain):
                    return True
    return False


def _plain_closure(node: Any) -> list[Any] | None:
    """``node`` and its ``allOf`` members (recursively); None where a ``$ref`` or ``true`` is
    met (not read here)."""
    if node is False:
        return [False]
    if not isinstance(node, dict) or "$ref" in node:
        return None
    out = [node]
    for member in node.get("allOf", []) if isinstance(node.get("allOf"), list) else ():
        sub = _plain_closure(member)
        if sub is None:
            return None
        out.extend(sub)
    return out


def _branch_words(node: Any) -> list[set[str]]:
    """For each ``anyOf`` / ``oneOf`` of ``node`` whose branches all list their strings (or
    admit none), the union of those lists."""
    unions = []
    for key in ("anyOf", "oneOf"):
        branches = node.get(key) if isinstance(node, dict) else None
        if not isinstance(branches, list) or not branches:
            continue
        union: set[str] = set()
        for branch in branches:
            plain = _plain_closure(branch)
            if plain is not None and (plain == [False] or not _admits_strings(plain)):
                continue
            words = _string_words(plain) if plain is not None else None
            if words is None:
                break
            union.update(words)
        else:
            unions.append(union)
    return unions


def _admits_strings(closure: list[Any]) -> bool:
    """Whether no schema of ``closure`` rules strings out by ``type`` or a list of values."""
    for node in closure:
        if not isinstance(node, dict):
            continue
        kinds = type_list(node.get("type"))
        if kinds is not None and "string" not in kinds:
            return False
        listed = _listed_values(node)
        if listed is not None and not any(isinstance(v, str) for v in listed):
            return False
    return True


def _listed_words(closure: list[Any]) -> tuple[str, ...] | None:
    """The words of an item of ``closure`` that is a string from a short list (tracked word by
    word, ``Places.item_words``, its array counted by :func:`cap_listed_items`); None when it
    may be something else or comes from no such list."""
    return _string_words(closure) if _only_strings(closure) else None


def _listed_values(node: Any) -> list[Any] | None:
    """A schema's ``enum`` members, or its ``const`` as one; None when it has neither."""
    if not isinstance(node, dict):
        return None
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    return [node["const"]] if "const" in node else None


def _surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def cap_listed_items(schema: Any) -> tuple[Any, dict[str, tuple[int, int]]]:
    """``schema`` (marked by :func:`mark_unique_items`) with ``maxItems`` lowered on each marked
    array (its ``type`` names ``array``) whose later items are strings alone from a short list
    (:func:`_string_words`): its items are distinct, so it holds at most one item per word
    (and per word of a listed ``prefixItems`` position, each other position one more). Why:
    the tracker sees what a token completes, not the comma that opens an item no word is left
    for; a grammar that counts the items refuses that comma. An array-only node that needs
    more items than that (``minItems``) becomes ``false`` (the emptiness check then says
    whether the whole schema is empty: an optional property or another branch may not be);
    returned by pointer with ``(most, least)``, for its message."""
    short: dict[str, tuple[int, int]] = {}
    if not any(True for _ in _nodes_with(schema, MARK)):
        return schema, short  # nothing marked: no walk, no copy
    analysis = _Analysis(schema, MARK)  # a marked schema: its refs resolve

    def listed(node: Any) -> tuple[str, ...] | None:
        try:
            return _listed_words(analysis._conjuncts([node]))
        except _Refused:  # a ref the analysis does not follow: no list
            return None

    def cap(node: Any, at: str) -> Any:
        if not isinstance(node, dict):
            return node
        node = map_subschemas(node, at, cap)
        kinds = type_list(node.get("type")) or []
        # a type that names arrays: a count on an untyped node is one some backends do not read
        if node.get(MARK) is not True or "array" not in kinds:
            return node
        words = listed(node.get("items")) if isinstance(node.get("items"), dict) else None
        if words is None:
            return node
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        pool, others = set(words), 0
        for item in prefix:
            own = listed(item) if isinstance(item, dict) else None
            if own is None:
                others += 1
            else:
                pool.update(own)
        most = min(len(prefix) + len(words), len(pool) + others)
        least, was = node.get("minItems", 0), node.get("maxItems")
        if isinstance(least, int) and least > most and kinds == ["array"]:
            short[at] = (most, least)
            return False
        if isinstance(was, int) and not isinstance(was, bool) and was <= most:
            return node
        return {**node, "maxItems": most}

    return cap(schema, ""), short
