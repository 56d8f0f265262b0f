"""The xgrammar adapter: every grammar kind, compiled by ``xgrammar.GrammarCompiler``.

- JSON_SCHEMA / ANY_JSON (any JSON value, schema ``{}``): ``compile_json_schema`` with
  whitespace bounded by ``BackendOptions.json_max_whitespace`` (``max_whitespace_cnt``) and
  ``strict_mode=False`` (JSON Schema semantics: ``additionalProperties`` defaults to
  allowed); numbers bounded by ``BackendOptions.json_number_bounds``
  (``constrained/schema/number_bounds.py``).
- REGEX: ``compile_regex``; EBNF (GBNF): ``compile_grammar`` with root rule ``root``, respelled
  where xgrammar reads GBNF otherwise than llama.cpp (``gbnf.py``);
  LARK: ``compile_lark``; CHOICE: a GBNF alternation of escaped string literals.
- STRUCTURAL_TAG: ``compile_structural_tag``, each ``json_schema`` node with the number bounds
  and, unless it sets its own, ``max_whitespace_cnt`` from the options (at least 1). xgrammar
  reads those schemas in its strict mode (objects closed, tuples not extended, unless the
  schema says otherwise), so each one spells JSON Schema's defaults (:func:`open_by_default`).

The vocabulary is given to xgrammar as raw bytes with special tokens (stops included) as empty
strings, so xgrammar never matches a control token as text; stop tokens are passed separately.

Compiles run in child processes (``constrained/xgrammar_child.py``, at most
``BackendOptions.compile_slots`` at once, all kept warm) that a compile cache kills at the
compile's deadline: xgrammar cannot cancel a compile, and one can take minutes. The grammar comes
back in xgrammar's own serialized form (``CompiledGrammar.serialize_json``, UTF-8; read back by
:func:`deserialize_compiled`).
``BackendOptions.xgrammar_memory_limit = 0`` compiles in the calling process instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import xgrammar

from espalier.constrained.backends.common import (
    BackendOptions,
    CompiledBase,
    MatcherBase,
    VocabFacts,
    canonical_forced_tokens,
    vocab_facts,
)
from espalier.constrained.backends.xgrammar.gbnf import xgrammar_gbnf
from espalier.constrained.backends.xgrammar.tree_walk import walk_xgrammar, walk_xgrammar_nodes
from espalier.constrained.compile_pool import ChildPool, ChildRefusedError
from espalier.constrained.errors import InvalidGrammarError, UnsupportedGrammarError
from espalier.constrained.regex_dialect import (
    dot_without_newline,
    in_lark_terminals,
    lark_token_reference,
    names_surrogate,
    own_common_terminals,
    python_reads,
    xgrammar_misreading,
)
from espalier.constrained.schema.number_bounds import bound_schema_numbers
from espalier.constrained.schema.respell import open_pattern_ends
from espalier.constrained.schema.walk import map_subschemas, walk
from espalier.constrained.spec import BackendName, GrammarKind, GrammarSpec
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.walk import Walker

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarMatcher
    from espalier.constrained.tokenizer import TokenizerInfo

NAME = BackendName.XGRAMMAR
CHILD_MODULE = "espalier.constrained.xgrammar_child"
_LOCATION = re.compile(r"line (\d+), column (\d+)")
_LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+?:\d+: ")
# a failed C++ check's own words before xgrammar's message ("Check failed: (cond) is false: ")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")


class Backend:
    """xgrammar bound to one tokenizer; ``compile`` is thread-safe."""

    name = NAME
    kinds = frozenset(GrammarKind)

    def __init__(self, tokenizer: TokenizerInfo, options: BackendOptions) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.facts = vocab_facts(tokenizer)
        self.tokenizer_info = tokenizer_info(tokenizer)
        self.compiler = xgrammar.GrammarCompiler(
            self.tokenizer_info, max_threads=options.max_threads, cache_enabled=False
        )
        self.pool: ChildPool | None = None
        if options.xgrammar_memory_limit > 0:
            info = self.tokenizer_info
            serialized = tokenizer.backend_view(
                "xgrammar.serialized", lambda tok: info.serialize_json().encode("utf-8")
            )
            head = json.dumps({"max_threads": options.max_threads}).encode()
            limit, slots = options.xgrammar_memory_limit, options.compile_slots
            # one pool per tokenizer and child configuration, shared by every Backend built on
            # it: the bound is per library, and a child costs seconds to start (xgrammar
            # imports torch)
            self.pool = tokenizer.backend_view(
                f"xgrammar.pool:{options.max_threads}:{limit}:{slots}",
                lambda tok: ChildPool(
                    NAME,
                    CHILD_MODULE,
                    head + b"\n" + serialized,
                    memory_limit=limit,
                    max_children=slots,
                    # every slot warm: after a kill the next compile finds a child ready instead
                    # of waiting out a child start (seconds under load) on its own deadline
                    warm=slots,
                ),
            )

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        method, kwargs = self.request(spec)
        if self.pool is not None:
            try:
                text = self.pool.ask(json.dumps({"method": method, "kwargs": kwargs}).encode())
            except ChildRefusedError as refused:
                raise _invalid(spec.kind, RuntimeError(str(refused)), spec.source) from None
            native = deserialize_compiled(text, self.tokenizer_info)
        else:
            try:
                native = getattr(self.compiler, method)(**kwargs)
            except (RuntimeError, ValueError, TypeError) as exc:
                raise _invalid(spec.kind, exc, spec.source) from exc
        return CompiledGrammar(spec, self.tokenizer, self.facts, native)

    def request(self, spec: GrammarSpec) -> tuple[str, dict[str, Any]]:
        """The ``GrammarCompiler`` method and its keyword arguments (JSON values) for ``spec``."""
        kind = spec.kind
        surrogate = _surrogate_in(spec)
        if surrogate is not None:  # xgrammar wrote such a code point's bytes: not UTF-8
            raise UnsupportedGrammarError(NAME, kind.value, f"the grammar names {surrogate}")
        if kind in (GrammarKind.JSON_SCHEMA, GrammarKind.ANY_JSON):
            ws = self.options.json_max_whitespace
            source = (
                self.options.json_source(_searched(spec), NAME)
                if kind is GrammarKind.JSON_SCHEMA
                else "{}"
            )
            return "compile_json_schema", {
                "schema": source,
                "any_whitespace": ws > 0,
                "max_whitespace_cnt": ws if ws > 0 else None,
                "separators": None if ws > 0 else [",", ":"],
                "strict_mode": False,
            }
        if kind is GrammarKind.REGEX:
            _refuse_unknown_escapes(spec.source)
            misread = xgrammar_misreading(spec.source)
            if misread is not None:
                raise UnsupportedGrammarError(NAME, kind.value, f"xgrammar reads {misread}")
            return "compile_regex", {"regex": dot_without_newline(spec.source)}
        if kind is GrammarKind.EBNF:
            grammar = xgrammar_gbnf(spec.source)
            return "compile_grammar", {"grammar": grammar, "root_rule_name": "root"}
        if kind is GrammarKind.LARK:
            misread = lark_misreading(spec.source)
            if misread is not None:
                raise UnsupportedGrammarError(NAME, kind.value, f"xgrammar reads {misread}")
            return "compile_lark", {"lark_string": own_common_terminals(spec.source)}
        if kind is GrammarKind.STRUCTURAL_TAG:
            return "compile_structural_tag", {"structural_tag": self._structural_tag(spec)}
        assert kind is GrammarKind.CHOICE
        if any("\0" in option for option in spec.choices):
            # xgrammar's literals end at a NUL: "a\u0000b" became "a"
            raise UnsupportedGrammarError(NAME, kind.value, "an option holds a NUL character")
        options = " | ".join(gbnf_literal(option) for option in spec.choices)
        return "compile_grammar", {"grammar": f"root ::= {options}", "root_rule_name": "root"}

    def _structural_tag(self, spec: GrammarSpec) -> str:
        from espalier.constrained.structural_tag import (
            json_whitespace,
            map_formats,
            map_json_schemas,
            map_regexes,
            root_format,
            with_format,
        )

        def bounded(node: dict[str, Any], pointer: str) -> dict[str, Any]:
            out = dict(node)
            out["max_whitespace_cnt"] = json_whitespace(node, self.options.json_max_whitespace)
            bounds = self.options.json_number_bounds
            out["json_schema"] = open_by_default(open_pattern_ends(node["json_schema"]))
            if bounds is not None:
                out["json_schema"] = bound_schema_numbers(out["json_schema"], NAME, bounds)
            return out

        def regex(node: dict[str, Any], pointer: str) -> dict[str, Any]:
            pattern = str(node.get("pattern", ""))
            if not pattern:  # xgrammar fails a check on it ("Check failed: ...")
                raise UnsupportedGrammarError(
                    NAME, GrammarKind.STRUCTURAL_TAG.value, f"an empty regex at {pointer}"
                )
            misread = regex_misreading(pattern)
            if misread is not None:  # as for a regex constraint (regex_dialect)
                raise UnsupportedGrammarError(
                    NAME, GrammarKind.STRUCTURAL_TAG.value, f"xgrammar reads {misread} at {pointer}"
                )
            return {**node, "pattern": dot_without_newline(pattern)}

        def grammar(node: dict[str, Any], pointer: str) -> dict[str, Any]:
            if node.get("syntax", "ebnf") != "ebnf":
                misread = lark_misreading(str(node.get("grammar", "")))
                if misread is not None:
                    raise UnsupportedGrammarError(
                        NAME,
                        GrammarKind.STRUCTURAL_TAG.value,
                        f"xgrammar reads {misread} at {pointer}",
                    )
                return node
            return {**node, "grammar": xgrammar_gbnf(str(node.get("grammar", "")))}

        fmt = map_regexes(map_json_schemas(root_format(spec), bounded), regex)
        return with_format(map_formats(fmt, ("grammar",), grammar)).source


def open_by_default(schema: Any) -> Any:
    """``schema`` with JSON Schema's defaults written out where xgrammar's strict mode would
    read them otherwise: ``additionalProperties: true`` on object schemas without it, ``items:
    true`` beside a ``prefixItems`` without it. Unchanged when the schema uses
    ``unevaluatedProperties`` / ``unevaluatedItems`` (there the written default would evaluate
    what they constrain); strict mode then narrows it, which never lets a wrong value through."""
    if not isinstance(schema, dict) or '"unevaluated' in json.dumps(schema):
        return schema
    return _open_node(schema, "")


def _open_node(node: Any, pointer: str) -> Any:
    if not isinstance(node, dict):
        return node
    out = map_subschemas(node, pointer, _open_node)
    kind = out.get("type")
    objects = kind == "object" or (isinstance(kind, list) and "object" in kind)
    if (objects or "properties" in out or "required" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = True
    if "prefixItems" in out and "items" not in out:
        out["items"] = True
    return out


class CompiledGrammar(CompiledBase):
    """A compiled xgrammar grammar; ``native`` is the ``xgrammar.CompiledGrammar``."""

    def __init__(
        self,
        spec: GrammarSpec,
        tokenizer: TokenizerInfo,
        facts: VocabFacts,
        native: xgrammar.CompiledGrammar,
    ) -> None:
        super().__init__(NAME, spec, tokenizer)
        self.native = native
        self._facts = facts

    @property
    def memory_bytes(self) -> int:
        return int(self.native.memory_size_bytes)

    def matcher(self) -> Matcher:
        return Matcher(self, xgrammar.GrammarMatcher(self.native))


class MatcherBatch:
    """xgrammar's batch entry point (``GrammarMatcher.batch_kind``): ``BatchGrammarMatcher``,
    whose C++ thread pool fills the rows with the GIL released."""

    def __init__(self, threads: int) -> None:
        self.batch = xgrammar.BatchGrammarMatcher(threads)

    def fill_next_rows(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
        faults: dict[int, BaseException],
    ) -> None:
        """See ``BatchStep.fill_next_rows``."""
        mine = [m for m in matchers if isinstance(m, Matcher)]
        assert len(mine) == len(matchers)
        self.batch.batch_fill_next_token_bitmask([m.native for m in mine], bitmask, list(rows))
        for matcher, row in zip(mine, rows):
            matcher.clear_tail(bitmask, row)

    def accept_runs(
        self,
        matchers: Sequence[GrammarMatcher],
        runs: Sequence[Sequence[int]],
        accepted: list[int],
        faults: dict[int, BaseException],
    ) -> None:
        """See ``BatchStep.accept_runs``: position by position, one ``batch_accept_token`` for
        every matcher whose run goes on and whose token is plain text there
        (``MatcherBase.takes_natively``); stop and special tokens through ``accept``."""
        mine = [m for m in matchers if isinstance(m, Matcher)]
        assert len(mine) == len(matchers)
        going = [j for j, run in enumerate(runs) if run]
        position = 0
        while going:
            native: list[int] = []
            still: list[int] = []
            for j in going:
                token = runs[j][position]
                if mine[j].takes_natively(token):
                    native.append(j)
                    continue
                try:
                    if mine[j].accept(token):
                        still.append(j)
                except Exception as exc:
                    faults[j] = exc
            if native:
                tokens = [runs[j][position] for j in native]
                results = xgrammar.BatchGrammarMatcher.batch_accept_token(
                    [mine[j].native for j in native], tokens
                )
                still.extend(j for j, ok in zip(native, results) if ok)
            position += 1
            for j in still:
                accepted[j] = position
            going = sorted(j for j in still if position < len(runs[j]))


class Matcher(MatcherBase):
    """Per-request state; ``native`` is the ``xgrammar.GrammarMatcher``."""

    batch_kind = MatcherBatch

    def __init__(self, compiled: CompiledGrammar, native: xgrammar.GrammarMatcher) -> None:
        super().__init__(compiled.tokenizer, compiled._facts)
        self.compiled = compiled
        self.native = native

    def _native_accept(self, token: int) -> bool:
        return bool(self.native.accept_token(token))

    def _native_rollback(self, n: int) -> None:
        self.native.rollback(n)

    def _native_fill(self, bitmask: torch.Tensor, index: int) -> None:
        # xgrammar was built with vocab_size = V: padding ids are special and come out as 0.
        self.native.fill_next_token_bitmask(bitmask, index)

    def _native_can_terminate(self) -> bool:
        return bool(self.native.is_completed())

    def _native_reset(self) -> None:
        self.native.reset()

    def forced_tokens(self, limit: int) -> list[int]:
        if limit <= 0 or self.is_terminated():
            return []
        forced = self.native.find_jump_forward_string()
        return canonical_forced_tokens(self, forced.encode("utf-8"), limit)

    def fork(self) -> Matcher:
        other = Matcher(self.compiled, self.native.fork())
        self._copy_state_to(other)
        return other

    def _tree_walks(self, tree: DraftTree, threads: int) -> tuple[Walker, Walker | None]:
        """xgrammar's native ``traverse_draft_tree`` (``tree_walk.py``); under a budget a
        node-by-node walk on a helper thread, since one xgrammar fill can take milliseconds.
        One thread whatever ``threads`` says."""
        return walk_xgrammar, walk_xgrammar_nodes


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF double-quoted string literal (control characters as ``\\uHHHH``:
    xgrammar reads a ``\\x`` escape's hex digits past two, so ``"\\x01abc"`` was U+1ABC).
    No NUL: xgrammar ends a literal there."""
    out = ['"']
    for char in text:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\r":
            out.append("\\r")
        elif char == "\t":
            out.append("\\t")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def tokenizer_info(tokenizer: TokenizerInfo) -> xgrammar.TokenizerInfo:
    """xgrammar's view of ``tokenizer``, built once per tokenizer: shared by every ``Backend``
    and by loads from the on-disk cache, which need no compiler."""
    # backend_view holds the tokenizer's lock: the facts are built first, without re-entering
    facts = vocab_facts(tokenizer)
    return tokenizer.backend_view(  # type: ignore[no-any-return]
        NAME, lambda tok: _build_tokenizer_info(tok, facts)
    )


def _build_tokenizer_info(tokenizer: TokenizerInfo, facts: VocabFacts) -> xgrammar.TokenizerInfo:
    control = facts.excluded | facts.stops
    encoded: list[Any] = [
        b"" if token_id in control else piece for token_id, piece in enumerate(facts.token_bytes)
    ]
    return xgrammar.TokenizerInfo(
        encoded,
        xgrammar.VocabType.RAW,
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=sorted(facts.stops),
        add_prefix_space=False,
    )


def deserialize_compiled(
    data: bytes, tokenizer_info: xgrammar.TokenizerInfo
) -> xgrammar.CompiledGrammar:
    """The grammar ``CompiledGrammar.serialize_json`` wrote (UTF-8), bound to ``tokenizer_info``
    (the same vocabulary it was compiled for)."""
    return xgrammar.CompiledGrammar.deserialize_json(data.decode("utf-8"), tokenizer_info)


_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
KNOWN_ESCAPE_LETTERS = frozenset("dDwWsSbBnrtfvxupPkc")
"""Letters xgrammar's regex reads after a backslash as more than the letter. It reads any other
(``\\q``) as the letter itself, where llguidance, outlines-core and the post-validator refuse
it: such a regex would be enforced as something its writer did not write."""


def _unknown_escape(regex: str) -> tuple[str, int] | None:
    """The first ``\\`` + letter xgrammar would read as the letter, and its column."""
    for escape in _ESCAPE.finditer(regex):
        char = escape.group(1)
        if char.isascii() and char.isalpha() and char not in KNOWN_ESCAPE_LETTERS:
            return (
                f"unknown escape \\{char} (xgrammar would read it as '{char}')",
                escape.start() + 1,
            )
    return None


def _refuse_unknown_escapes(regex: str) -> None:
    """Raise InvalidGrammarError at the first ``\\`` + letter xgrammar would read as the letter."""
    unknown = _unknown_escape(regex)
    if unknown is not None:
        raise InvalidGrammarError(GrammarKind.REGEX.value, unknown[0], column=unknown[1])


def regex_misreading(pattern: str) -> str | None:
    """What xgrammar reads otherwise in a regex inside another grammar (a structural tag's
    ``regex``, a Lark terminal): an unknown escape, or :func:`xgrammar_misreading`."""
    unknown = _unknown_escape(pattern)
    if unknown is not None:
        return f"an {unknown[0]} at column {unknown[1]}"
    return xgrammar_misreading(pattern)


def lark_misreading(source: str) -> str | None:
    """What xgrammar reads otherwise in a Lark grammar (its regex terminals; a token reference
    such as ``<[0-100]>``, whose mask allowed ``<eos>`` and ``[multimodal]``), or None."""
    reference = lark_token_reference(source)
    if reference is not None:
        return f"a token reference ({reference}) as something else"
    return in_lark_terminals(source, regex_misreading)


def _surrogate_in(spec: GrammarSpec) -> str | None:
    """Where ``spec`` names a surrogate code point (``regex_dialect.names_surrogate``): in a
    grammar's source or a schema's patterns (a schema's own text cannot hold one: ``json_text``
    refuses lone ``\\u`` surrogates)."""
    if spec.kind in (GrammarKind.EBNF, GrammarKind.LARK):
        return names_surrogate(spec.source)
    if spec.kind is not GrammarKind.JSON_SCHEMA:
        return None
    for node in walk(spec.schema):
        if not isinstance(node.schema, dict):
            continue
        pattern, named = node.schema.get("pattern"), node.schema.get("patternProperties")
        texts = [pattern] if isinstance(pattern, str) else []
        texts += list(named) if isinstance(named, dict) else []
        for text in texts:
            if (found := names_surrogate(text)) is not None:
                return found
    return None


def _searched(spec: GrammarSpec) -> GrammarSpec:
    """``spec`` with its patterns anchored as ``regex.search`` reads them: xgrammar reads every
    ``pattern`` as a full match (``"a+"`` refused ``"xay"``)."""
    schema = open_pattern_ends(spec.schema)
    return spec if schema == spec.schema else GrammarSpec.json_schema(schema, max_bytes=1 << 30)


def _invalid(
    kind: GrammarKind, exc: Exception, source: str = ""
) -> InvalidGrammarError | UnsupportedGrammarError:
    message = str(exc).strip()
    message = _LOG_PREFIX.sub("", message.splitlines()[0] if message else type(exc).__name__)
    message = _CHECK_FAILED.sub("", message)
    if kind is GrammarKind.REGEX and "Regex parsing error" in message and python_reads(source):
        # Python's regex module read it (GrammarSpec.regex): xgrammar's syntax does not
        return UnsupportedGrammarError(
            NAME, kind.value, f"xgrammar's regex syntax does not read it ({message})"
        )
    line = column = None
    match = _LOCATION.search(message)
    if match is not None and kind in (GrammarKind.EBNF, GrammarKind.LARK):
        line, column = int(match.group(1)), int(match.group(2))
    return InvalidGrammarError(kind.value, message, line=line, column=column)
