"""The llguidance adapter: every grammar kind, checked by an ``llguidance.LLMatcher`` at compile
time and run by llguidance's C API (``native/capi.py``): one C-API matcher per request.

- JSON_SCHEMA / ANY_JSON (any JSON value, schema ``{}``): ``grammar_from_json_schema`` with
  ``lenient=False`` (unimplemented keywords are errors, never silently dropped) and whitespace
  bounded by ``BackendOptions.json_max_whitespace``; compact separators when that is 0; numbers
  bounded by ``BackendOptions.json_number_bounds`` (``constrained/schema/number_bounds.py``).
- REGEX: ``grammar_from_regex``; LARK: ``grammar_from_lark``; EBNF (GBNF): llguidance's own
  ``gbnf_to_lark`` converter; CHOICE: a Lark alternation of string literals;
  STRUCTURAL_TAG: Lark where it is exact (``backends/llguidance/tags.py``), else refused.

A matcher goes into a sticky error state when it consumes a bad token, so :meth:`accept`
validates each token before consuming it (``capi.accept_batch``), as the Python API's
``try_consume_tokens`` does.

llguidance (1.9.1) keeps a memo of the masks it computed (keyed, as its behaviour shows, by
lexer state and Earley row index) that ``rollback`` does not clear: after a rollback, tokens that
rebuild a row at the same index with the same lexer state (``[`` + ``["``, mask, rollback 1,
`` "``: both inside a string, one array deep vs two) get the rolled-back branch's mask
(``"]"`` allowed, ``"}"`` not). After a rollback the adapter computes a mask at the rolled-back
state, into a scratch row, before the next consume unless a fill comes first
(:meth:`Matcher.refresh_mask_memo`): that repairs the case above, **but not every case**
(``tests/constrained/test_llguidance_stale_rollback.py``: a mask two tokens down, a rollback, a
mask at the rolled-back state, and a sibling still gets the branch's mask). So nothing that
needs exact masks rolls an llguidance matcher back after computing masks below: the tree walk
starts siblings from clones (``tree_walk.py``), and probes that
roll back check tokens by consuming them, not by masks (closing paths), or probe on a fork
(forced chains below draft leaves: ``Matcher.exact_rollback`` is False).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import llguidance
import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.backends.common import (
    BackendOptions,
    CompiledBase,
    MatcherBase,
    VocabFacts,
    schema_refusal,
    vocab_facts,
)
from espalier.constrained.backends.llguidance import gbnf_lexing
from espalier.constrained.backends.llguidance.closing import LlgClosing, closing_of
from espalier.constrained.backends.llguidance.errors import MatcherStateError
from espalier.constrained.backends.llguidance.literals import (
    MAX_LITERAL_BYTES,
    hanging_terminal,
    longest_literal,
)
from espalier.constrained.backends.llguidance.native import capi as llg_native
from espalier.constrained.backends.llguidance.tree_batch import NativeTreeBatch
from espalier.constrained.backends.llguidance.tree_walk import walk_llguidance
from espalier.constrained.compile_pool import InProcessLane
from espalier.constrained.errors import (
    EmptyLanguageError,
    GrammarError,
    InvalidGrammarError,
    UnsupportedGrammarError,
)
from espalier.constrained.regex_dialect import (
    in_lark_terminals,
    lark_token_reference,
    own_common_terminals,
    python_reads,
    rust_misreading,
)
from espalier.constrained.schema.refs import inline_boolean_refs
from espalier.constrained.spec import BackendName, GrammarKind, GrammarSpec
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.walk import Walker

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarMatcher
    from espalier.constrained.tokenizer import TokenizerInfo

NAME = BackendName.LLGUIDANCE
ENCODE_CACHE_ENTRIES = 4096
"""Texts whose token ids the llguidance tokenizer callback remembers (cleared when full)."""
_LARK_LOCATION = re.compile(r"^(?:at )?(\d+)\((\d+)\):", re.MULTILINE)
_GBNF_LINE = re.compile(r"at line (\d+),")
_UNSATISFIABLE = "Unsatisfiable schema"
_WHILE_PROCESSING = re.compile(r"while processing (\S*)")
_DEF_URI = re.compile(r"json-schema:///#/\$defs/([^/]+)")
MAX_EMPTY_DEFS = 16  # $defs entries set to false before a schema is refused
ACCEPTS_PER_THREAD = 8
"""Matchers per native thread of a batch accept (a run costs a few µs a token, a thread's start
tens: fewer matchers than this stay on the calling thread)."""

FORKS_PER_THREAD = 2
"""Forks per native thread of a batch that makes them (``capi.fork_batch``): each one's clone
copies the lexer, tens of µs, as long as a thread's start."""


_LIMITS = llguidance.LLParserLimits(step_max_items=llg_native.STEP_MAX_ITEMS)


class Backend:
    """llguidance bound to one tokenizer; ``compile`` is thread-safe."""

    name = NAME
    kinds = frozenset(GrammarKind)

    def __init__(self, tokenizer: TokenizerInfo, options: BackendOptions) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.facts = vocab_facts(tokenizer)
        self.lane = InProcessLane(options.compile_slots)
        facts = self.facts  # backend_view holds the tokenizer's lock: build without re-entering
        self.lltokenizer = tokenizer.backend_view(NAME, lambda tok: _build_lltokenizer(tok, facts))
        # the same tokenizer through llguidance's C API, which every request's matcher uses
        # (built on a background thread; the first compile waits for it)
        llg_native.api()  # raises NativeBuildError now, not at the first request
        self.native_slot: llg_native.NativeTokenizerSlot = tokenizer.backend_view(
            "llguidance.native", lambda tok: _native_slot(tok, facts)
        )

    def tree_walk(self, timeout: float | None = None) -> str:
        """ "native" once the C-API tokenizer is built (waits up to ``timeout``), else why not
        ("not ready (...)"): the tree walk, the matchers and the closing searches all use it."""
        if self.native_slot.wait(timeout) is not None:
            return "native"
        return f"not ready ({self.native_slot.error or 'native tokenizer not built yet'})"

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self.lane.slot():  # in-process: llguidance bounds its own compile work
            return self._compile(spec)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        length = longest_literal(spec)
        if length > MAX_LITERAL_BYTES:
            raise UnsupportedGrammarError(
                NAME,
                spec.kind.value,
                f"it holds a literal of {length} bytes, over {MAX_LITERAL_BYTES}: inside it "
                "each of llguidance's token masks costs time in proportion to its length",
            )
        grammar, checked = self._template(spec)
        tokenizer = self.native_slot.wait()
        if tokenizer is None:
            raise RuntimeError(f"llguidance's C-API tokenizer: {self.native_slot.error}")
        try:
            template = tokenizer.matcher(grammar)
        except RuntimeError as exc:  # the Python API took it: not expected
            raise _invalid(spec, str(exc)) from exc
        # never used, not even for a mask: a clone inherits the lexer budget its source spent,
        # so a warmed template would change what every request accepts (issue 39)
        return CompiledGrammar(
            spec, self.tokenizer, self.facts, checked, grammar, template, self.native_slot
        )

    def _template(self, spec: GrammarSpec) -> tuple[str, llguidance.LLMatcher]:
        """The grammar text and its compiled matcher. llguidance compiles each ``$defs`` entry
        a ref reaches and refuses the whole JSON schema when one has no instance
        ("Unsatisfiable schema ... while processing #/$defs/x"), even when only an optional
        property reaches it: that entry is then written ``false`` (the same language: it had no
        instance) and the compile retried, up to MAX_EMPTY_DEFS times. Unsatisfiable at the root
        (other than by its regex reasoning): no value matches (EmptyLanguageError)."""
        grammar = self.grammar_text(spec)
        source: str | None = None
        for _ in range(MAX_EMPTY_DEFS + 1):
            template = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=_LIMITS)
            if not template.is_error():
                return grammar, template
            message = template.get_error()
            name = _unsatisfiable_def(message) if spec.kind is GrammarKind.JSON_SCHEMA else None
            if name == "" and "Regex is empty" not in message:
                raise EmptyLanguageError(spec.kind.value, f"no JSON value matches: {message}")
            if not name:
                break
            source = source or self.options.json_source(spec, NAME)
            schema = json.loads(source)
            defs = schema.get("$defs") if isinstance(schema, dict) else None
            if not isinstance(defs, dict) or defs.get(name, False) is False:
                break
            defs[name] = False
            source = json.dumps(inline_boolean_refs(schema), ensure_ascii=False)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                source, overrides=self._json_options()
            )
        # a pattern Python's regex module reads (GrammarSpec.regex, and every JSON schema
        # pattern at admission: schema.guard): llguidance's syntax does not
        regex_limit = "regex parse error" in message and (
            spec.kind is GrammarKind.JSON_SCHEMA
            or (spec.kind is GrammarKind.REGEX and python_reads(spec.source))
        )
        if regex_limit:
            detail = message[message.rfind("error:") :].splitlines()[0]
            what = "it" if spec.kind is GrammarKind.REGEX else "a pattern of the schema"
            raise UnsupportedGrammarError(
                NAME, spec.kind.value, f"llguidance's regex syntax does not read {what} ({detail})"
            )
        raise _invalid(spec, message)

    def grammar_text(self, spec: GrammarSpec) -> str:
        """The llguidance grammar (JSON text) for ``spec``; raises InvalidGrammarError."""
        kind = spec.kind
        if kind in (GrammarKind.JSON_SCHEMA, GrammarKind.ANY_JSON):
            source = (
                self.options.json_source(spec, NAME) if kind is GrammarKind.JSON_SCHEMA else "{}"
            )
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    source, overrides=self._json_options()
                )
            except ValueError as exc:
                raise InvalidGrammarError(kind.value, str(exc)) from exc
        if kind is GrammarKind.REGEX:
            misread = rust_misreading(spec.source)
            if misread is not None:
                raise UnsupportedGrammarError(NAME, kind.value, f"llguidance reads {misread}")
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if kind is GrammarKind.LARK:
            misread = in_lark_terminals(spec.source, rust_misreading)
            if misread is not None:
                raise UnsupportedGrammarError(NAME, kind.value, f"llguidance reads {misread}")
            _refuse_hanging_terminal(spec.source, kind)
            reference = lark_token_reference(spec.source)
            if reference is not None:  # its masks allowed them, its matcher refused them
                raise UnsupportedGrammarError(
                    NAME, kind.value, f"a token reference ({reference}): tokens, not text"
                )
            return llguidance.LLMatcher.grammar_from_lark(own_common_terminals(spec.source))
        if kind is GrammarKind.EBNF:
            try:
                lark = gbnf_lexing.lark_of(spec.source)
            except Exception as exc:  # the converter raises assorted errors on bad input
                match = _GBNF_LINE.search(str(exc))
                line = int(match.group(1)) if match else None
                raise InvalidGrammarError(kind.value, str(exc), line=line) from exc
            reason = gbnf_lexing.refusal(spec.source)
            if reason is not None:
                raise UnsupportedGrammarError(NAME, kind.value, reason)
            _refuse_hanging_terminal(lark, kind)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        if kind is GrammarKind.STRUCTURAL_TAG:
            from espalier.constrained.backends.llguidance.tags import structural_tag_grammar

            ws, bounds = self.options.json_max_whitespace, self.options.json_number_bounds
            text = structural_tag_grammar(spec, self._json_options(), ws, bounds)
            for grammar in json.loads(text)["grammars"]:
                _refuse_hanging_terminal(str(grammar.get("lark_grammar", "")), kind)
            return text
        assert kind is GrammarKind.CHOICE
        # DEL is the one character json.dumps leaves raw that llguidance's Lark lexer refuses
        options = " | ".join(
            json.dumps(option, ensure_ascii=False).replace("\x7f", "\\u007f")
            for option in spec.choices
        )
        return llguidance.LLMatcher.grammar_from_lark(f"start: {options}")

    def _json_options(self) -> Any:
        ws = self.options.json_max_whitespace
        if ws <= 0:
            return {
                "lenient": False,
                "whitespace_flexible": False,
                "item_separator": ",",
                "key_separator": ":",
            }
        return {
            "lenient": False,
            "whitespace_flexible": True,
            "whitespace_pattern": self.options.whitespace_regex,
        }


class CompiledGrammar(CompiledBase):
    """A validated llguidance grammar.

    ``native`` is the Python ``LLMatcher`` the compile checked the grammar with (its errors
    name what is wrong); ``grammar`` is the llguidance grammar text. ``template`` is the same
    grammar through the C API (``native/capi.py``) at its start state, never used: every
    request's matcher is a clone of it (:meth:`matcher`, tens of µs on Gemma, against a
    compile's milliseconds). A C-API clone is deep: its lexer and lexer budget are its own
    (issue 39: one request never spends another's budget), and a clone of an unused template
    accepts exactly what a fresh compile does.
    """

    def __init__(
        self,
        spec: GrammarSpec,
        tokenizer: TokenizerInfo,
        facts: VocabFacts,
        checked: llguidance.LLMatcher,
        grammar: str,
        template: llg_native.NativeMatcher,
        native_slot: llg_native.NativeTokenizerSlot,
    ) -> None:
        super().__init__(NAME, spec, tokenizer)
        self.native = checked
        self.grammar = grammar
        self._facts = facts
        self.native_slot = native_slot
        self._template = template
        self._template_lock = threading.Lock()  # one clone at a time: a matcher is one thread's

    def native_start(self) -> llg_native.NativeMatcher:
        """A new C-API matcher at the start state (a clone of the unused template)."""
        with self._template_lock:
            return self._template.clone()

    @property
    def memory_bytes(self) -> int:
        """An estimate for the compile cache's bound: llguidance reports no sizes, and builds its
        lexer lazily as masks are computed. Measured per cached grammar (a process's resident
        growth, Gemma and a 300-token vocabulary alike): a regex 0.002-0.06 MB, a 4-property
        schema 0.16-0.27 MB, a 32-property one (1.5 KB of grammar) 0.5 MB with its start mask
        only, and 2-3 MB for JSONSchemaBench-like schemas (~1 KB) after a 60-token walk; the
        old ``4 * len + 64 KiB`` (70 KB) let a 512 MB cache hold gigabytes."""
        return len(self.grammar) * 512 + (1 << 20)

    def matcher(self) -> Matcher:
        return Matcher(self, self.native_start())


class NativeBatch:
    """The plain step's batch fill and accept (``GrammarMatcher.batch_kind``): the rows in one
    call of the native tree walk (``native/llg_walk.c``), each matcher a one-node tree, on up
    to ``threads`` native threads with the GIL released."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)

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
        if not (bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda):
            raise ValueError("bitmask must be a contiguous int32 CPU tensor")
        if any(m._row_bytes != bitmask.shape[1] * 4 for m in mine):
            raise ValueError("bitmask row does not cover the vocabulary")
        ready: list[int] = []
        for j, matcher in enumerate(mine):
            try:
                if matcher._stop_depth or matcher.native.is_error():
                    matcher.fill_bitmask(bitmask, rows[j])  # stop row, or its error
                    continue
                if matcher.mask_memo_stale:
                    matcher.refresh_mask_memo()
                ready.append(j)
            except Exception as exc:
                faults[j] = exc
        if not ready:
            return
        n = len(ready)
        nodes = np.arange(n + 1, dtype=np.int64)
        trees = llg_native.BatchTrees(
            roots=np.array([mine[j].native.pointer for j in ready], dtype=np.uint64),
            tokens=np.zeros(n, dtype=np.int64),
            parents=np.full(n, -1, dtype=np.int64),
            node_at=nodes,
            row_at=np.array([rows[j] for j in ready], dtype=np.int64),
            flag_at=nodes[:-1],
            filter_states=np.zeros(n, dtype=np.uint64),
        )
        compiled = mine[ready[0]].compiled
        end = llg_native.walk_batch(
            llg_native.api(),
            trees,
            bitmask.numpy(),
            np.zeros((3, n), dtype=np.uint8),
            compiled.native_slot.tables,
            compiled.tokenizer.vocab_size,
            -1.0,
            self.threads,
        )
        for b, j in enumerate(ready):
            mine[j].mask_memo_stale = False
            message = end.errors.get(b)
            if message is not None:
                faults[j] = MatcherStateError(f"llguidance: {message}")

    def accept_runs(
        self,
        matchers: Sequence[GrammarMatcher],
        runs: Sequence[Sequence[int]],
        accepted: list[int],
        faults: dict[int, BaseException],
    ) -> None:
        """See ``BatchStep.accept_runs``: the runs of text tokens in one native call on up to
        ``threads`` threads (``capi.accept_batch``, the GIL released), others one by one. Lazy
        forks (``Matcher.clone_source``) are made in a call of their own
        (``capi.fork_batch``): their clones on the native threads too."""
        native: list[int] = []
        mine: list[Matcher] = []
        forks: dict[int, llg_native.NativeMatcher] = {}  # index in mine -> its clone's source
        sources: set[int] = set()  # their ids: a source is cloned once a call
        for j, (matcher, run) in enumerate(zip(matchers, runs)):
            try:
                if isinstance(matcher, Matcher) and run and matcher.takes_all_natively(run):
                    source = matcher.clone_source()
                    if source is not None and id(source) not in sources:
                        sources.add(id(source))
                        forks[len(mine)] = source
                    elif matcher.mask_memo_stale:
                        matcher.refresh_mask_memo()
                    native.append(j)
                    mine.append(matcher)
                else:
                    accepted[j] = matcher.accept_tokens(run)
            except Exception as exc:
                faults[j] = exc
        if not native:
            return
        lib = llg_native.api()
        counts = [0] * len(mine)
        if forks:
            made = llg_native.fork_batch(
                lib,
                list(forks.values()),
                [runs[native[k]] for k in forks],
                min(self.threads, max(1, len(forks) // FORKS_PER_THREAD)),
            )
            for k, (clone, count) in zip(forks, made):
                if clone is None:
                    faults[native[k]] = MemoryError("llguidance returned no matcher")
                    continue
                mine[k]._native = clone
                counts[k] = count
        rest = [k for k in range(len(mine)) if k not in forks]
        if rest:
            taken = llg_native.accept_batch(
                lib,
                [mine[k].native for k in rest],
                [runs[native[k]] for k in rest],
                min(self.threads, len(rest) // ACCEPTS_PER_THREAD),
            )
            for k, count in zip(rest, taken):
                counts[k] = count
        for k, (j, matcher) in enumerate(zip(native, mine)):
            if j in faults:
                continue
            if counts[k] < 0:
                faults[j] = MatcherStateError(f"llguidance: {matcher.native.error()}")
                continue
            matcher.history.extend(runs[j][: counts[k]])
            accepted[j] = counts[k]


class Matcher(MatcherBase):
    """Per-request state; ``native`` is a C-API matcher (``native/capi.py``), this request's
    alone: a clone of the grammar's template, advanced only by this request's own accepts.

    The native tree walk runs from it (``tree_walk.py``: it computes the root row on it and
    walks clones), and closing searches clone it. A fork (:meth:`fork`) is lazy: until it is
    advanced or asked for a mask it is only its source's history and closing base, and its C-API
    matcher is made then (``_materialize``). A clone copies the lexer (68-109 µs once it has
    grown), and the closing lookahead forks every request near its budget at every step, for
    searches that run natively from the base on the mask threads.
    """

    exact_rollback = False  # a stale mask can survive a rollback (module docstring)
    batch_kind = NativeBatch
    tree_batch_kind = NativeTreeBatch

    def __init__(
        self,
        compiled: CompiledGrammar,
        native: llg_native.NativeMatcher | None,
        history: list[int] | None = None,
        base: tuple[llg_native.NativeMatcher, int] | None = None,
    ) -> None:
        super().__init__(compiled.tokenizer, compiled._facts)
        self.compiled = compiled
        self._native = native
        self._row_bytes = 4 * ((compiled.tokenizer.vocab_size + 31) // 32)
        # True after a rollback until a mask is computed: llguidance's mask memo may describe a
        # rolled-back branch (module docstring), so the next consume must refresh it first.
        self.mask_memo_stale = False
        self._scratch: np.ndarray | None = None
        # the text tokens consumed, in order (a lazy fork's state; the closing bases' replay)
        self.history: list[int] = history if history is not None else []
        # a C-API matcher at the first n tokens of history that is never advanced (any thread
        # may clone it; forks share it): closing searches and lazy forks start from it
        self.closing_base: tuple[llg_native.NativeMatcher, int] | None = base
        # the matcher this one was forked from (None: a request's own): a base a search on
        # this fork hands back at their common history also serves it (``closing._install``)
        self.origin: Matcher | None = None
        self._forked_on = 0  # the thread that made this fork (``_materialize``)
        self.helper_rows = 0  # tree rows a walk's second thread filled (all walks; a statistic)
        # a fork was made since the last walk: the next walk hands back a snapshot of this
        # matcher, its new closing base (``took_snapshot``)
        self.snapshot_wanted = False
        self._eos = compiled.tokenizer.stop_token_ids[0]  # llguidance's EOS (_TokenizerSource)

    @property
    def native(self) -> llg_native.NativeMatcher:
        """This matcher's C-API matcher (a lazy fork's is made here: the class docstring)."""
        native = self._native
        if native is None:
            native = self._native = self._materialize()
        return native

    @property
    def materialized(self) -> bool:
        """Whether :attr:`native` exists (False: a fork not used yet)."""
        return self._native is not None

    def _materialize(self) -> llg_native.NativeMatcher:
        """A lazy fork's C-API matcher: a clone of its source where that is safe (the thread
        that forked it, which owns the source, and the source still at the fork's state), else
        a clone of the closing base that consumes the rest of the history."""
        source = self.clone_source()
        if source is not None:
            return source.clone()
        base = self.closing_base
        if base is None:
            native, length = self.compiled.native_start(), 0
        else:
            native, length = base[0].clone(), base[1]
        rest = self.history[length:]
        if rest and native.try_consume(rest) != len(rest):
            raise MatcherStateError(f"llguidance: a fork could not replay: {native.error()}")
        return native

    def clone_source(self) -> llg_native.NativeMatcher | None:
        """For a lazy fork: the C-API matcher to clone as its own, its origin's, where that is
        safe (this thread made the fork and owns the origin, and the origin is still at the
        fork's state), its mask memo refreshed first (a clone carries it along); else None
        (``_materialize`` then replays from the closing base)."""
        origin = self.origin
        if (
            self._native is not None
            or origin is None
            or origin._native is None
            or self._forked_on != threading.get_ident()
            or origin.history != self.history
        ):
            return None
        if origin.mask_memo_stale:
            origin.refresh_mask_memo()
        origin.snapshot_wanted = False  # this fork needs no snapshot: it has its own
        return origin._native

    def refresh_mask_memo(self) -> None:
        """Compute the mask into a scratch row, so llguidance's memo describes this state.

        Needed after a ``rollback`` and before the next consume (module docstring); one mask.
        """
        if self._scratch is None:
            self._scratch = np.zeros(self._row_bytes // 4, dtype=np.int32)
        self.native.mask_into(self._scratch)
        self.mask_memo_stale = False

    def _consume(self, tokens: Sequence[int]) -> int:
        """Consume the allowed prefix of text tokens ``tokens``; its length."""
        if self.mask_memo_stale:
            self.refresh_mask_memo()
        native = self.native
        accepted = native.try_consume(tokens)
        if accepted < 0:
            raise MatcherStateError(f"llguidance: {native.error()}")
        if accepted:
            self.history.extend(tokens[:accepted])
        return accepted

    def _native_accept(self, token: int) -> bool:
        return self._consume((token,)) == 1

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        # One native call for the run of plain text tokens at the front (closing-path checks
        # accept whole paths); the rest token by token.
        if self._stop_depth or not tokens:
            return super().accept_tokens(tokens)
        facts, vocab = self._facts, self._tokenizer_vocab
        run = 0
        for token in tokens:
            if not 0 <= token < vocab or token in facts.excluded or token in facts.stops:
                break
            run += 1
        accepted = self._consume(list(tokens[:run])) if run else 0
        if accepted < run:
            return accepted
        return accepted + super().accept_tokens(tokens[run:])

    def _native_rollback(self, n: int) -> None:
        if n > len(self.history):
            raise ValueError(f"llguidance cannot roll back {n} tokens: {len(self.history)} known")
        if self._native is not None and not self._native.rollback(n):
            raise ValueError(f"llguidance cannot roll back {n} tokens: {self._native.error()}")
        self.mask_memo_stale = self._native is not None
        del self.history[len(self.history) - n :]
        if self.closing_base is not None and self.closing_base[1] > len(self.history):
            self.closing_base = None

    def fill_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        # Flattened override of MatcherBase.fill_bitmask: the per-step hot path.
        if self._stop_depth or self._tail is not None:
            super().fill_bitmask(bitmask, index)
            return
        self._native_fill(bitmask, index)

    def _native_fill(self, bitmask: torch.Tensor, index: int) -> None:
        if not (bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda):
            raise ValueError("bitmask must be a contiguous int32 CPU tensor")
        if bitmask.shape[-1] * 4 != self._row_bytes:
            raise ValueError("bitmask row does not cover the vocabulary")
        rows = bitmask.shape[0] if bitmask.dim() == 2 else 1
        if not 0 <= index < rows:
            raise IndexError(f"bitmask row {index} out of range")
        native = self.native
        # accept() never consumes a bad token, but a mask can hit a runtime limit (the lexer's
        # fuel, the parser's row limit): llguidance then writes an EOS-only row, which would end
        # the request early as if it were done. It is this request's error instead.
        try:
            native.mask_at(bitmask.data_ptr() + index * self._row_bytes, self._row_bytes)
        except RuntimeError as exc:
            raise MatcherStateError(f"llguidance: {native.error()}") from exc
        self.mask_memo_stale = False
        if native.is_error():
            raise MatcherStateError(f"llguidance: {native.error()}")

    def _native_can_terminate(self) -> bool:
        return self.native.is_accepting()

    def completes(self, tokens: Sequence[int]) -> bool:
        # llguidance validates a run without consuming it; a stop token after it is allowed
        # exactly when it can end there
        if not tokens or not self.takes_all_natively(tokens):
            return super().completes(tokens)
        return self._validate([*tokens, self._eos]) == len(tokens) + 1

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        # ``validate_tokens`` counts what a consume would take, consuming nothing
        if not tokens or not self.takes_all_natively(tokens):
            return super().accepted_prefix(tokens)
        return self._validate(list(tokens))

    def _validate(self, tokens: list[int]) -> int:
        """How many of ``tokens`` llguidance would consume (``validate_tokens``: none is)."""
        if self.mask_memo_stale:
            self.refresh_mask_memo()
        native = self.native
        valid = native.validate(tokens)
        if valid < 0 or native.is_error():
            raise MatcherStateError(f"llguidance: {native.error()}")
        return valid

    def _native_reset(self) -> None:
        self._native = self.compiled.native_start()
        self.mask_memo_stale = False
        self.history.clear()
        self.closing_base = None

    def forced_tokens(self, limit: int) -> list[int]:
        if limit <= 0 or self.is_terminated():
            return []
        return self.native.forced_tokens(limit)

    def native_closing(self, token: int | None, limit: int, keys: int = 0) -> LlgClosing | None:
        return closing_of(self, token, limit, keys)

    def took_snapshot(self, snapshot: llg_native.NativeMatcher | None) -> None:
        """A walk's snapshot of this matcher (None: none taken) becomes its closing base: the
        lookahead's forks, made before the walk, search from it (``closing.closing_of``) with
        nothing to replay and a lexer as warm as this matcher's."""
        if snapshot is not None:
            self.closing_base = (snapshot, len(self.history))
            self.snapshot_wanted = False

    def prepare(self, scratch: torch.Tensor) -> None:
        """See ``GrammarMatcher.prepare``; also the closing base that a first fork would
        otherwise clone from the template (under the grammar's lock) on the engine thread."""
        super().prepare(scratch)
        if self.closing_base is None and not self.history:
            self.closing_base = (self.compiled.native_start(), 0)

    def fork(self) -> Matcher:
        self.snapshot_wanted = True
        base = self.closing_base
        if base is None:
            base = self.closing_base = (self.compiled.native_start(), 0)
        other = Matcher(self.compiled, None, list(self.history), base)
        self._copy_state_to(other)
        other.origin = self
        other._forked_on = threading.get_ident()
        return other

    def _tree_walks(self, tree: DraftTree, threads: int) -> tuple[Walker, Walker | None]:
        """The native walk, inline (it checks the budget between nodes, in C); ``threads`` > 1
        lets it share a branchy tree with a second thread."""
        walk = partial(walk_llguidance, threads=threads) if threads > 1 else walk_llguidance
        return walk, None


class _TokenizerSource:
    """What ``llguidance.TokenizerWrapper`` reads: our token bytes, specials and encoder.

    Building from the token bytes is ~5x faster than ``llguidance.hf.from_tokenizer`` (which
    re-parses the whole tokenizer.json: ~30 s for Gemma's 262k ids) and uses the same bytes as the
    other backends.
    """

    def __init__(self, tokenizer: TokenizerInfo, facts: VocabFacts) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.stop_token_ids[0]
        self.bos_token_id = None
        padding = range(tokenizer.tokenizer_vocab_size, tokenizer.vocab_size)
        # llguidance sizes its masks from this list: model padding ids are empty special tokens
        self.tokens = facts.token_bytes + [b""] * len(padding)
        self.special_token_ids = sorted(facts.excluded | facts.stops) + list(padding)
        self._encoded: dict[str, tuple[int, ...]] = {}

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # makes TokenizerWrapper pass str, never partial UTF-8
            raise TypeError("text only")
        # llguidance calls back here from inside mask computations (to tokenize the rest of a
        # forced lexeme, e.g. a property name), holding the GIL for a ~50 µs HF encode each
        # time, and asks for the same few strings again and again: remember them.
        ids = self._encoded.get(text)
        if ids is None:
            ids = tuple(self._tokenizer.encode_text(text))
            if len(self._encoded) >= ENCODE_CACHE_ENTRIES:
                self._encoded.clear()
            self._encoded[text] = ids
        return list(ids)


def _native_slot(tokenizer: TokenizerInfo, facts: VocabFacts) -> llg_native.NativeTokenizerSlot:
    def source() -> llg_native.TokenizerSource:
        python_side = _TokenizerSource(tokenizer, facts)
        return llg_native.TokenizerSource(
            python_side.tokens,
            python_side.special_token_ids,
            list(tokenizer.stop_token_ids),
            python_side,
        )

    words = bm.words_per_row(tokenizer.vocab_size)
    tables = llg_native.walk_tables(
        words, tokenizer.tokenizer_vocab_size, sorted(facts.excluded), sorted(facts.stops)
    )
    return llg_native.NativeTokenizerSlot(source, tables)


def _unsatisfiable_def(message: str) -> str | None:
    """The ``$defs`` entry an "Unsatisfiable schema" error names; "" for the root; None when
    the error is another one."""
    if not message.startswith(_UNSATISFIABLE):
        return None
    match = _WHILE_PROCESSING.search(message)
    if match is None:
        return ""
    place = _DEF_URI.fullmatch(match.group(1))
    if place is None:
        return None
    return unquote(place.group(1)).replace("~1", "/").replace("~0", "~")


def _build_lltokenizer(tokenizer: TokenizerInfo, facts: VocabFacts) -> llguidance.LLTokenizer:
    wrapper = llguidance.TokenizerWrapper(_TokenizerSource(tokenizer, facts))
    return llguidance.LLTokenizer(
        wrapper, n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.stop_token_ids)
    )


def _invalid(spec: GrammarSpec, message: str) -> GrammarError:
    """llguidance's compile error as ours: a size limit of llguidance's ("too big", "schema
    too large": a 389-byte JSONSchemaBench schema with ``not`` over ``patternProperties``) is
    no fault of the grammar, so another backend may take it, nor is a JSON schema form it
    says is "not supported"; anything else is invalid."""
    kind = spec.kind
    if "too big" in message or "schema too large" in message:
        return UnsupportedGrammarError(
            NAME,
            kind.value,
            f"llguidance's lexer for this grammar passes its size limit ({message.strip()}): "
            "the grammar is valid but too large here; fewer or smaller alternatives (oneOf / "
            "anyOf branches, enum values, patterns) fit",
        )
    if kind is GrammarKind.JSON_SCHEMA and "not supported" in message:
        # e.g. "circular references with sibling keys are not supported" (held-out sweep)
        return schema_refusal(NAME, spec, message.strip())
    line = column = None
    match = _LARK_LOCATION.search(message)
    # locations refer to the Lark text llguidance saw: the caller's own text only for LARK
    if match is not None and kind is GrammarKind.LARK:
        line, column = int(match.group(1)), int(match.group(2))
    return InvalidGrammarError(kind.value, message.strip(), line=line, column=column)


def _refuse_hanging_terminal(lark: str, kind: GrammarKind) -> None:
    """UnsupportedGrammarError for a Lark text with a terminal llguidance's masks can hang on
    (:func:`~espalier.constrained.backends.llguidance.literals.hanging_terminal`)."""
    terminal = hanging_terminal(lark)
    if terminal is not None:
        raise UnsupportedGrammarError(
            NAME,
            kind.value,
            f"its terminal {terminal} repeats one string without bound: llguidance's mask can "
            "hang when a terminal starting with that string may follow it",
        )
