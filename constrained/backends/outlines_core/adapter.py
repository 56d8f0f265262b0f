"""The outlines-core adapter: regular languages only, as a token-level DFA (``Index``).

- JSON_SCHEMA: ``json_schema.build_regex_from_schema`` with whitespace bounded by
  ``BackendOptions.json_max_whitespace``, its integer and number sub-regexes bounded by
  ``BackendOptions.json_number_bounds`` (``constrained/schema/number_bounds.py``); REGEX: as given,
  less a leading ``^`` and trailing ``$`` (``regex_dialect.without_end_anchors``);
  CHOICE: an alternation of escaped literals. EBNF and LARK are not regular, and ANY_JSON (a
  depth-3 unrolled regex) makes the token DFA explode (minutes even on a 300-token vocabulary):
  ``UnsupportedGrammarError``.
- The Index is built in a child process (``index.py``): capped in memory and
  killed at a compile cache's deadline, since a build can take minutes and many GiB.
- Stop tokens and special tokens are left out of its vocabulary (its one EOS id is never used).
- outlines-core 0.2.14 drops every transition from a final DFA state to a non-final one (``a(bc)*``
  accepts ``a`` but then refuses ``b``). So the regex we compile is ``(?:R)`` followed by a sentinel
  character (U+10FFFD) spelled by one fake token (the id of a special non-stop token, never
  allowed itself): final states come only after the sentinel, and the text so far is a complete
  match iff the sentinel leads to a final state (inside a JSON string it is just a character).
  Tokens containing the byte 0xF4 (the lead byte of U+100000..U+10FFFF, private-use planes) are
  left out of its vocabulary so no real token can spell the sentinel.
- A ``Guide`` cannot be copied cheaply, so :meth:`Matcher.fork` replays the accepted tokens on a
  new ``Guide`` over the shared ``Index``.
"""

from __future__ import annotations

import ctypes
import json
import pickle
import threading
import weakref
from typing import TYPE_CHECKING, Any

import outlines_core
import torch

from espalier.constrained.backends.common import (
    BackendOptions,
    BackendUnavailableError,
    CompiledBase,
    MatcherBase,
    VocabFacts,
    canonical_forced_tokens,
    schema_refusal,
    vocab_facts,
)
from espalier.constrained.backends.outlines_core.index import IndexBuilder
from espalier.constrained.backends.outlines_core.tree_walk import walk_outlines
from espalier.constrained.errors import InvalidGrammarError, UnsupportedGrammarError
from espalier.constrained.regex_dialect import python_reads, rust_misreading, without_end_anchors
from espalier.constrained.schema.features import NOT_ASSERTING
from espalier.constrained.schema.number_bounds import bound_number_regex
from espalier.constrained.schema.walk import map_subschemas, walk
from espalier.constrained.spec import BackendName, GrammarKind, GrammarSpec
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.walk import Walker

if TYPE_CHECKING:
    from espalier.constrained.tokenizer import TokenizerInfo

NAME = BackendName.OUTLINES_CORE
MAX_ROLLBACK = 1 << 20
# a state allowing more tokens than this is treated as "nothing forced" (checking is too costly)
_FORCED_MAX_BRANCHING = 4096
_FORCED_MAX_BYTES = 512
_FORCED_MAX_DEPTH = 256
"""States deep a forced-bytes walk recurses (a forced ``é{1000}`` is 2,000 states of one-byte
tokens: past Python's recursion limit, which reached the client as INTERNAL)."""
SENTINEL = "\U0010fffd"
_SENTINEL_REGEX = r"\x{10FFFD}"
_SENTINEL_LEAD_BYTE = 0xF4


class Backend:
    """outlines-core bound to one tokenizer; ``compile`` is thread-safe."""

    name = NAME
    kinds = frozenset({GrammarKind.JSON_SCHEMA, GrammarKind.REGEX, GrammarKind.CHOICE})

    def __init__(self, tokenizer: TokenizerInfo, options: BackendOptions) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.facts = vocab_facts(tokenizer)
        if not self.facts.excluded:
            raise BackendUnavailableError(
                NAME,
                "outlines-core",
                "the tokenizer has no special non-stop token to use as sentinel",
            )
        self.sentinel_id = min(self.facts.excluded)
        facts, sentinel_id = self.facts, self.sentinel_id  # no re-entry into backend_view's lock
        self.vocabulary = tokenizer.backend_view(
            NAME, lambda tok: _build_vocabulary(facts, sentinel_id)
        )
        limit = options.outlines_memory_limit
        self.builder = (
            IndexBuilder(self.vocabulary, limit, options.compile_slots) if limit > 0 else None
        )

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        regex = self.regex(spec)
        sentinel_ended = f"(?:{regex}){_SENTINEL_REGEX}"
        try:
            if self.builder is not None:
                index = self.builder.build(sentinel_ended, spec.kind.value)
            else:
                try:
                    index = outlines_core.Index(sentinel_ended, self.vocabulary)
                except (ValueError, TypeError, RuntimeError) as exc:
                    raise InvalidGrammarError(spec.kind.value, str(exc)) from exc
        except InvalidGrammarError as exc:
            if spec.kind is GrammarKind.JSON_SCHEMA:
                detail = f"outlines-core cannot index its regex: {exc.detail}"
                raise schema_refusal(NAME, spec, detail) from exc
            if spec.kind is not GrammarKind.REGEX or not python_reads(spec.source):
                raise
            # Python's regex module read it (GrammarSpec.regex): outlines-core cannot, which
            # says nothing against the regex ("Failed to build DFA error building NFA")
            raise UnsupportedGrammarError(
                NAME,
                spec.kind.value,
                "outlines-core compiles a regex into a DFA and does not read this one "
                "(lookarounds, backreferences, atomic groups, \\N{...}, \\R and \\X are "
                f"not in its syntax): {exc.detail}",
            ) from exc
        return CompiledGrammar(spec, self.tokenizer, self.facts, index, regex, self.sentinel_id)

    def regex(self, spec: GrammarSpec) -> str:
        """The regex outlines-core compiles for ``spec``; raises on unsupported or bad input."""
        kind = spec.kind
        if kind not in self.kinds:
            raise UnsupportedGrammarError(
                NAME, kind.value, "outlines-core handles regular languages"
            )
        if kind is GrammarKind.REGEX:
            misread = rust_misreading(spec.source)
            if misread is not None:
                raise UnsupportedGrammarError(NAME, kind.value, f"outlines-core reads {misread}")
            plain = without_end_anchors(spec.source)
            if plain is None:  # an end marker follows the regex: anchors would not hold
                raise UnsupportedGrammarError(NAME, kind.value, "an anchor inside the regex")
            return plain
        if kind is GrammarKind.CHOICE:
            return "|".join(f"({escape_literal(option)})" for option in spec.choices)
        anywhere = _any_value_at(spec.schema)
        if anywhere is not None:
            raise UnsupportedGrammarError(
                NAME,
                kind.value,
                f"the schema takes any JSON value at {anywhere or '/'}: outlines-core's index of "
                "one takes minutes and GiBs, or its regex builder refuses it (llguidance and "
                "xgrammar take it)",
            )
        source = json_escaped_names(spec.source)
        refused = "outlines-core's regex builder refuses it"
        try:
            if self.builder is not None:  # in a capped child: some schemas' regexes take GBs
                regex = self.builder.schema_regex(source, self.options.whitespace_regex, kind.value)
            else:
                regex = outlines_core.json_schema.build_regex_from_schema(
                    source, self.options.whitespace_regex
                )
        except InvalidGrammarError as exc:
            raise schema_refusal(NAME, spec, f"{refused}: {exc.detail}") from exc
        except (ValueError, TypeError, RuntimeError) as exc:
            raise schema_refusal(NAME, spec, f"{refused}: {exc}") from exc
        bounds = self.options.json_number_bounds
        integer_rx, number_rx = outlines_core.json_schema.INTEGER, outlines_core.json_schema.NUMBER
        if bounds is None or integer_rx in spec.source:  # a caller's pattern spells it: keep
            return regex
        return bound_number_regex(regex, integer_rx, number_rx, bounds)


def _any_value_at(schema: Any) -> str | None:
    """The pointer of the first subschema of ``schema`` that asserts nothing (``true``, ``{}``,
    annotations only), else None: the depth-unrolled regex of any JSON value, whose token index
    ran 5 minutes into a 4 GiB limit (a request waited for its 30 s compile limit). Below the
    root too: a property ``{}`` timed out at 30 s, one holding only a ``description`` failed
    as "Unsupported JSON Schema structure" (held-out sweep)."""
    for node in walk(schema):
        value = node.schema
        if value is True or (isinstance(value, dict) and all(k in NOT_ASSERTING for k in value)):
            return node.pointer
    return None


RESIDENT_PER_PICKLED_BYTE = 2.4
"""An Index's resident bytes per byte of its pickle (the compile cache's estimate): a process
grew 512-567 MB per Gemma-vocabulary ``maxLength`` string grammar whose pickle was 237-246 MB
(2.2-2.3x); counting the pickle alone let a 512 MB cache hold indexes of 1.1 GB."""


def _return_freed_memory() -> None:
    """Give the heap's free pages back to the system once an Index is gone, on a thread of its
    own (``malloc_trim`` walks every arena). Why: glibc keeps what its arenas freed, and an Index
    is hundreds of MB allocated on whichever thread unpickled it: without this the engine
    process grew by each evicted grammar until the allocator failed and the process aborted
    (a held-out sweep: 2.7 -> 4.9 GB over four grammars, then "memory allocation failed")."""
    if _MALLOC_TRIM is not None:
        threading.Thread(target=_MALLOC_TRIM, args=(0,), daemon=True).start()


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


class CompiledGrammar(CompiledBase):
    """``native`` is the ``outlines_core.Index`` (token-level DFA over ``(?:regex)`` + sentinel).

    ``regex`` is the caller's language; ``sentinel_id`` the fake token that ends it: a state can
    terminate iff its transition on ``sentinel_id`` leads to a final state.
    """

    def __init__(
        self,
        spec: GrammarSpec,
        tokenizer: TokenizerInfo,
        facts: VocabFacts,
        index: Any,
        regex: str,
        sentinel_id: int,
    ) -> None:
        super().__init__(NAME, spec, tokenizer)
        self.native = index
        self.regex = regex
        self.sentinel_id = sentinel_id
        self._facts = facts
        self._memory_bytes = int(len(pickle.dumps(index)) * RESIDENT_PER_PICKLED_BYTE)
        weakref.finalize(self, _return_freed_memory)
        self._forced: dict[int, bytes] = {}  # DFA state -> bytes every continuation starts with
        self._forced_lock = threading.Lock()

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes

    def matcher(self) -> Matcher:
        return Matcher(self)

    def can_terminate(self, state: int) -> bool:
        """Whether the text that led to DFA ``state`` is a complete match."""
        nxt = self.native.get_next_state(state, self.sentinel_id)
        return nxt is not None and bool(self.native.is_final_state(nxt))

    def forced_bytes(self, state: int) -> bytes:
        """Longest byte string every continuation from DFA ``state`` starts with (memoised)."""
        with self._forced_lock:
            return self._forced_from(state, set())

    def _forced_from(self, state: int, visiting: set[int]) -> bytes:
        cached = self._forced.get(state)
        if cached is not None:
            return cached
        index = self.native
        if state in visiting or self.can_terminate(state):
            return b""
        if len(visiting) >= _FORCED_MAX_DEPTH:
            return b""  # deep enough: a shorter forced prefix is still one (not kept)
        tokens = [t for t in index.get_allowed_tokens(state) if t != self.sentinel_id]
        if not tokens or len(tokens) > _FORCED_MAX_BRANCHING:
            self._forced[state] = b""
            return b""
        token_bytes = self._facts.token_bytes
        tokens.sort(key=lambda t: -len(token_bytes[t]))
        visiting.add(state)
        result: bytes | None = None
        for token in tokens:
            piece = token_bytes[token]
            if result is not None and len(piece) >= len(result):
                candidate = piece  # what follows cannot lengthen the common prefix
            else:
                nxt = index.get_next_state(state, token)
                tail = b"" if nxt is None else self._forced_from(nxt, visiting)
                candidate = (piece + tail)[:_FORCED_MAX_BYTES]
            result = candidate if result is None else _common_prefix(result, candidate)
            if not result:
                break
        visiting.discard(state)
        forced = result or b""
        self._forced[state] = forced
        return forced


class Matcher(MatcherBase):
    """Per-request state; ``native`` is the ``outlines_core.Guide``."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        super().__init__(compiled.tokenizer, compiled._facts)
        self.compiled = compiled
        self.native = outlines_core.Guide(compiled.native, max_rollback=MAX_ROLLBACK)
        self._sentinel_word = compiled.sentinel_id >> 5
        self._sentinel_bit = 1 << (compiled.sentinel_id & 31)
        self._history: list[int] = []  # tokens given to the Guide, for fork()
        self._words = (compiled.tokenizer.vocab_size + 31) // 32

    def _native_accept(self, token: int) -> bool:
        try:
            self.native.advance(token, return_tokens=False)
        except ValueError:  # no transition: the Guide's state is unchanged
            return False
        self._history.append(token)
        return True

    def _native_rollback(self, n: int) -> None:
        if n > len(self._history):
            raise ValueError(f"cannot roll back {n} tokens: only {len(self._history)} accepted")
        self.native.rollback_state(n)
        del self._history[len(self._history) - n :]

    def _native_fill(self, bitmask: torch.Tensor, index: int) -> None:
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        assert bitmask.shape[-1] == self._words, "bitmask row does not cover the vocab"
        # outlines-core writes all `numel` words (zeros past its own vocabulary)
        pointer = bitmask.data_ptr() + index * self._words * 4
        self.native.write_mask_into(pointer, self._words, 4)
        word = int(bitmask[index, self._sentinel_word])
        if word & self._sentinel_bit:  # the fake token is never allowed itself
            bitmask[index, self._sentinel_word] = _as_int32(word & ~self._sentinel_bit)
            if self._native_can_terminate():  # the match can end here: the stop tokens instead
                bitmask[index].bitwise_or_(self._facts.stop_row)

    def _native_can_terminate(self) -> bool:
        return self.compiled.can_terminate(self.native.get_state())

    def _native_reset(self) -> None:
        self.native.reset()
        self._history.clear()

    def forced_tokens(self, limit: int) -> list[int]:
        if limit <= 0 or self.is_terminated():
            return []
        forced = self.compiled.forced_bytes(self.native.get_state())
        return canonical_forced_tokens(self, forced, limit)

    def fork(self) -> Matcher:
        other = Matcher(self.compiled)
        for token in self._history:
            other.native.advance(token, return_tokens=False)
        other._history = list(self._history)
        self._copy_state_to(other)
        return other

    def _tree_walks(self, tree: DraftTree, threads: int) -> tuple[Walker, Walker | None]:
        """DFA states by lookup, rows from the grammar's row cache (``tree_walk.py``), inline:
        no single fill is slow. One thread whatever ``threads`` says."""
        return walk_outlines, None


def json_escaped_names(source: str) -> str:
    """The schema text with each ``properties`` / ``required`` name written as JSON spells it
    inside a string (``a"b`` as ``a\\"b``). Why: outlines-core puts a name into its regex with
    regex escapes only, so a quote, backslash or control character came out raw (a held-out
    sweep: ``{"a"b": 83}`` under ``{"properties": {"a\\"b": ...}}``, valid=false)."""
    schema = json.loads(source)
    if not isinstance(schema, dict):
        return source
    escaped = _escape_names(schema, "")
    return source if escaped == schema else json.dumps(escaped, ensure_ascii=False)


def _escape_names(node: Any, pointer: str) -> Any:
    if not isinstance(node, dict):
        return node
    out = map_subschemas(node, pointer, _escape_names)
    names = out.get("properties")
    if isinstance(names, dict):
        out["properties"] = {_json_spelling(name): sub for name, sub in names.items()}
    required = out.get("required")
    if isinstance(required, list):
        out["required"] = [_json_spelling(n) if isinstance(n, str) else n for n in required]
    return out


def _json_spelling(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)[1:-1]


def escape_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (ASCII punctuation and controls as ``\\xHH``)."""
    out = []
    for char in text:
        if char.isalnum() or ord(char) > 0x7F or char in " _":
            out.append(char)
        else:
            out.append(f"\\x{ord(char):02X}")
    return "".join(out)


def _as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _common_prefix(a: bytes, b: bytes) -> bytes:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return a[:i]


def _build_vocabulary(facts: VocabFacts, sentinel_id: int) -> Any:
    """outlines-core ``Vocabulary``: text tokens (no special, stop, empty or 0xF4-byte tokens)
    plus the sentinel token."""
    by_bytes: dict[bytes, list[int]] = {}
    skip = facts.excluded | facts.stops
    for token_id, piece in enumerate(facts.token_bytes):
        if piece and token_id not in skip and _SENTINEL_LEAD_BYTE not in piece:
            by_bytes.setdefault(piece, []).append(token_id)
    by_bytes[SENTINEL.encode("utf-8")] = [sentinel_id]
    return outlines_core.Vocabulary(min(facts.stops), by_bytes)
