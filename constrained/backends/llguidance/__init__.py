"""The llguidance adapter: every grammar kind, compiled into an ``llguidance.LLMatcher``.

- JSON_SCHEMA / ANY_JSON (any JSON value, schema ``{}``): ``grammar_from_json_schema`` with
  ``lenient=False`` (unimplemented keywords are errors, never silently dropped) and whitespace
  bounded by ``BackendOptions.json_max_whitespace``; compact separators when that is 0; numbers
  bounded by ``BackendOptions.json_number_bounds`` (``constrained/schema/number_bounds.py``).
- REGEX: ``grammar_from_regex``; LARK: ``grammar_from_lark``; EBNF (GBNF): llguidance's own
  ``gbnf_to_lark`` converter; CHOICE: a Lark alternation of string literals;
  STRUCTURAL_TAG: Lark where it is exact (``backends/llguidance/tags.py``), else refused.

An ``LLMatcher`` goes into a sticky error state when it consumes a bad token, so :meth:`accept`
goes through ``try_consume_tokens``, which consumes a token only when it is allowed.

llguidance (1.9.1) keeps a memo of the masks it computed (keyed, as its behaviour shows, by
lexer state and Earley row index) that ``rollback`` does not clear: after a rollback, tokens that
rebuild a row at the same index with the same lexer state (``[`` + ``["``, mask, rollback 1,
`` "``: both inside a string, one array deep vs two) get the rolled-back branch's mask
(``"]"`` allowed, ``"}"`` not). After a rollback the adapter computes a mask at the rolled-back
state, into a scratch row, before the next consume unless a fill comes first
(:meth:`Matcher.refresh_mask_memo`): that repairs the case above, **but not every case**
(``tests/constrained/test_llguidance_stale_rollback.py``: a mask two tokens down, a rollback, a
mask at the rolled-back state, and a sibling still gets the branch's mask). So nothing that
needs exact masks rolls an llguidance matcher back after computing masks below: the tree walks
start siblings from ``deep_copy`` snapshots or clones (``tree_walk.py``), and probes that
roll back check tokens by consuming them, not by masks (closing paths), or probe on a fork
(forced chains below draft leaves: ``Matcher.exact_rollback`` is False).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from espalier.constrained import bitmask as bm
from espalier.constrained.backends.common import (
    BackendOptions,
    CompiledBase,
    MatcherBase,
    VocabFacts,
    vocab_facts,
)
from espalier.constrained.backends.llguidance.closing import LlgClosing, closing_of
from espalier.constrained.backends.llguidance.errors import MatcherStateError
from espalier.constrained.backends.llguidance.native import capi as llg_native
from espalier.constrained.backends.llguidance.tree_batch import NativeTreeBatch
from espalier.constrained.backends.llguidance.tree_walk import (
    native_takes,
    native_walk_ready,
    twin_of,
    walk_llguidance,
    walk_llguidance_py,
)
from espalier.constrained.compile_pool import InProcessLane
from espalier.constrained.errors import EmptyLanguageError, InvalidGrammarError
from espalier.constrained.schema.refs import inline_boolean_refs
from espalier.constrained.spec import BackendName, GrammarKind, GrammarSpec
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.walk import Walker

if TYPE_CHECKING:
    from espalier.constrained.backends.llguidance.native.twin import Twin
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
        # the same tokenizer through llguidance's C API, for the native tree walk (built on a
        # background thread; walks use the Python path until it is ready)
        self.native_slot: llg_native.NativeTokenizerSlot | None = None
        if options.llguidance_native_walk:
            llg_native.api()  # raises NativeBuildError now, not a silent slow path later
            self.native_slot = tokenizer.backend_view(
                "llguidance.native", lambda tok: _native_slot(tok, facts)
            )

    def tree_walk(self, timeout: float | None = None) -> str:
        """Which tree walk this backend's matchers get: "native", or "python (why)"; waits up
        to ``timeout`` for the native tokenizer to be built."""
        if self.native_slot is None:
            return "python (BackendOptions.llguidance_native_walk is off)"
        if self.native_slot.wait(timeout) is not None:
            return "native"
        return f"python ({self.native_slot.error or 'native tokenizer not built yet'})"

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self.lane.slot():  # in-process: llguidance bounds its own compile work
            return self._compile(spec)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        grammar, template = self._template(spec)
        compiled = CompiledGrammar(
            spec,
            self.tokenizer,
            self.facts,
            template,
            grammar,
            self.lltokenizer,
            self.native_slot,
            self.options.llguidance_native_max_branches,
        )
        if self.native_slot is not None and self.native_slot.built() is not None:
            compiled.native_template()  # its own lexer warms here too, not in a first walk
        return compiled

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
            template = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
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
        raise _invalid(spec.kind, message)

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
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if kind is GrammarKind.LARK:
            return llguidance.LLMatcher.grammar_from_lark(spec.source)
        if kind is GrammarKind.EBNF:
            try:
                lark = gbnf_to_lark(spec.source)
            except Exception as exc:  # the converter raises assorted errors on bad input
                match = _GBNF_LINE.search(str(exc))
                line = int(match.group(1)) if match else None
                raise InvalidGrammarError(kind.value, str(exc), line=line) from exc
            return llguidance.LLMatcher.grammar_from_lark(lark)
        if kind is GrammarKind.STRUCTURAL_TAG:
            from espalier.constrained.backends.llguidance.tags import structural_tag_grammar

            ws, bounds = self.options.json_max_whitespace, self.options.json_number_bounds
            return structural_tag_grammar(spec, self._json_options(), ws, bounds)
        assert kind is GrammarKind.CHOICE
        options = " | ".join(json.dumps(option, ensure_ascii=False) for option in spec.choices)
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

    ``native`` is the ``LLMatcher`` the compile checked the grammar with; ``grammar`` is the
    llguidance grammar text and ``lltokenizer`` the ``LLTokenizer``. Each :meth:`matcher` is a new
    ``LLMatcher`` made from ``grammar``, never a ``deep_copy`` of a shared one: copies share one
    lexer, with its lazily built states and its fuel ("too many expressions constructed" once
    spent, for every copy), so one request could spend another's budget or, once the lexer is in
    its error state, make every later request on the grammar fail. :meth:`native_template` is
    the same grammar through the C API (``constrained/backends/llguidance/native/capi.py``), for
    the native
    tree walk; C-API clones are deep (each has its own lexer).

    Making an ``LLMatcher`` compiles the grammar again (hundreds of times a ``deep_copy``): the
    engine makes each request's matcher off its step thread (``GrammarService.submit_request``).
    A new matcher is not warmed: a mask spends the lexer fuel that later consumes draw on.
    """

    def __init__(
        self,
        spec: GrammarSpec,
        tokenizer: TokenizerInfo,
        facts: VocabFacts,
        template: llguidance.LLMatcher,
        grammar: str,
        lltokenizer: llguidance.LLTokenizer,
        native_slot: llg_native.NativeTokenizerSlot | None = None,
        native_max_branches: int = BackendOptions.llguidance_native_max_branches,
    ) -> None:
        super().__init__(NAME, spec, tokenizer)
        self.native_max_branches = native_max_branches  # BackendOptions
        self.native = template
        self.grammar = grammar
        self.lltokenizer = lltokenizer
        self._facts = facts
        self.native_slot = native_slot
        self._native_lock = threading.Lock()
        self._native_template: llg_native.NativeMatcher | None = None
        self._native_failed = False

    def native_template(self) -> llg_native.NativeMatcher | None:
        """The C-API matcher at the start state (made and warmed on first call), or None while
        the native tokenizer is not ready or if llguidance refused the grammar there."""
        tokenizer = self.native_slot.get() if self.native_slot is not None else None
        if tokenizer is None:
            return None
        with self._native_lock:
            if self._native_template is None and not self._native_failed:
                try:
                    template = tokenizer.matcher(self.grammar)
                    scratch = np.zeros(bm.words_per_row(self.tokenizer.vocab_size), np.int32)
                    # C-API clones are deep (the lexer included): warm the template itself, so
                    # every twin starts with the start state's lexer built
                    template.mask_into(scratch)
                    self._native_template = template
                except RuntimeError:
                    self._native_failed = True
            return self._native_template

    def native_start(self) -> llg_native.NativeMatcher | None:
        """A new C-API matcher at the start state, or None (see :meth:`native_template`)."""
        template = self.native_template()
        if template is None:
            return None
        with self._native_lock:
            return template.clone()

    @property
    def memory_bytes(self) -> int:
        # llguidance builds its lexer lazily and does not report sizes: grammar text plus a
        # fixed allowance for the parser tables.
        return len(self.grammar) * 4 + 64 * 1024

    def matcher(self) -> Matcher:
        native = llguidance.LLMatcher(self.lltokenizer, self.grammar, log_level=0)
        if native.is_error():
            # the compile made one from the same text and limits, so this is not expected; the
            # compile's own matcher, used by no request, keeps matcher() from ever raising
            native = self.native.deep_copy()
        return Matcher(self, native)


class ExecutorBatch:
    """llguidance's batch entry point (``GrammarMatcher.batch_kind``): ``LLExecutor``, whose
    Rust threads fill the rows with the GIL released."""

    def __init__(self, threads: int) -> None:
        self.executor = llguidance.LLExecutor(threads)

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
        row_bytes = bitmask.shape[1] * 4
        if not (bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda):
            raise ValueError("bitmask must be a contiguous int32 CPU tensor")
        if any(m._row_bytes != row_bytes for m in mine):
            raise ValueError("bitmask row does not cover the vocabulary")
        ready: list[int] = []
        for j, matcher in enumerate(mine):
            try:
                if matcher.mask_memo_stale:
                    matcher.refresh_mask_memo()
                ready.append(j)
            except Exception as exc:
                faults[j] = exc
        pairs = [(mine[j].native, rows[j]) for j in ready]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0]
        )
        for j in ready:
            matcher = mine[j]
            matcher.mask_memo_stale = False
            if matcher.native.is_error():
                faults[j] = MatcherStateError(f"llguidance: {matcher.native.get_error()}")
            else:
                matcher.clear_tail(bitmask, rows[j])

    def accept_runs(
        self,
        matchers: Sequence[GrammarMatcher],
        runs: Sequence[Sequence[int]],
        accepted: list[int],
        faults: dict[int, BaseException],
    ) -> None:
        """See ``BatchStep.accept_runs``: one ``accept_tokens`` per matcher (one native
        ``try_consume_tokens`` for a run of text tokens); the Python API has no batch consume."""
        for j, (matcher, run) in enumerate(zip(matchers, runs)):
            try:
                accepted[j] = matcher.accept_tokens(run)
            except Exception as exc:
                faults[j] = exc


class Matcher(MatcherBase):
    """Per-request state; ``native`` is the ``llguidance.LLMatcher``."""

    exact_rollback = False  # a stale mask can survive a rollback (module docstring)
    batch_kind = ExecutorBatch
    tree_batch_kind = NativeTreeBatch

    def __init__(self, compiled: CompiledGrammar, native: llguidance.LLMatcher) -> None:
        super().__init__(compiled.tokenizer, compiled._facts)
        self.compiled = compiled
        self.native = native
        self._row_bytes = 4 * ((compiled.tokenizer.vocab_size + 31) // 32)
        # The last bitmask checked and its base address: the per-call checks cost about as much
        # as llguidance's own mask computation, so a tensor is checked once, not every step.
        self._checked_mask: weakref.ref[torch.Tensor] | None = None
        self._checked_ptr = 0
        self._checked_rows = 0
        # True after a rollback until a mask is computed: llguidance's mask memo may describe a
        # rolled-back branch (module docstring), so the next consume must refresh it first.
        self.mask_memo_stale = False
        self._scratch: np.ndarray | None = None
        # Tokens consumed natively, and the C-API twin the native tree walk runs from
        # (``tree_walk.py``, ``native/twin.py``): each walk catches it up first.
        self.history: list[int] = []
        self.twin: Twin | None = None
        # the C-API matcher closing searches clone, at the first n tokens of history
        # (``closing.py``): never advanced, shared with forks
        self.closing_base: tuple[llg_native.NativeMatcher, int] | None = None
        # the matcher this one was forked from (None: a request's own): a base a search on
        # this fork hands back at their common history also serves it (``closing._install``)
        self.origin: Matcher | None = None
        self._eos = compiled.tokenizer.stop_token_ids[0]  # llguidance's EOS (_TokenizerSource)

    def refresh_mask_memo(self) -> None:
        """Compute the mask into a scratch row, so llguidance's memo describes this state.

        Needed after a ``rollback`` and before the next consume (module docstring); one mask.
        """
        if self._scratch is None:
            self._scratch = np.zeros(self._row_bytes // 4, dtype=np.int32)
        self.native.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._row_bytes)
        self.mask_memo_stale = False

    def _native_accept(self, token: int) -> bool:
        # try_consume_tokens consumes nothing on a disallowed token, so the matcher never enters
        # its sticky error state (one native call: ~16 % cheaper than validate + consume)
        if self.mask_memo_stale:
            self.refresh_mask_memo()
        if self.native.try_consume_tokens([token]) == 1:
            self.history.append(token)
            return True
        if self.native.is_error():
            raise MatcherStateError(f"llguidance: {self.native.get_error()}")
        return False

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        # One native call for the run of plain text tokens at the front (closing-path checks
        # accept whole paths, ~5 us a call each otherwise); the rest token by token.
        if self._stop_depth or not tokens:
            return super().accept_tokens(tokens)
        facts, vocab = self._facts, self._tokenizer_vocab
        run = 0
        for token in tokens:
            if not 0 <= token < vocab or token in facts.excluded or token in facts.stops:
                break
            run += 1
        if self.mask_memo_stale:
            self.refresh_mask_memo()
        head = list(tokens[:run])
        accepted: int = self.native.try_consume_tokens(head) if head else 0
        if accepted:
            self.history.extend(head[:accepted])
        if accepted < run:
            if self.native.is_error():
                raise MatcherStateError(f"llguidance: {self.native.get_error()}")
            return accepted
        return accepted + super().accept_tokens(tokens[run:])

    def _native_rollback(self, n: int) -> None:
        if not self.native.rollback(n):
            raise ValueError(f"llguidance cannot roll back {n} tokens: {self.native.get_error()}")
        self.mask_memo_stale = True
        del self.history[len(self.history) - n :]
        if self.twin is not None and self.twin.length > len(self.history):
            self.twin = None  # it never rolls back (native/twin.py): the next walk makes one
        if self.closing_base is not None and self.closing_base[1] > len(self.history):
            self.closing_base = None

    def fill_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        # Flattened override of MatcherBase.fill_bitmask: this is the per-step hot path, and
        # llguidance's own mask takes ~5 us, so each Python-level call here shows.
        if self._stop_depth or self._tail is not None:
            super().fill_bitmask(bitmask, index)
            return
        self._native_fill(bitmask, index)

    def _native_fill(self, bitmask: torch.Tensor, index: int) -> None:
        checked = self._checked_mask() if self._checked_mask is not None else None
        if checked is not bitmask:
            if not (
                bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
            ):
                raise ValueError("bitmask must be a contiguous int32 CPU tensor")
            if bitmask.shape[-1] * 4 != self._row_bytes:
                raise ValueError("bitmask row does not cover the vocabulary")
            self._checked_mask = weakref.ref(bitmask)
            self._checked_ptr = bitmask.data_ptr()
            self._checked_rows = bitmask.shape[0]
        if not 0 <= index < self._checked_rows:
            raise IndexError(f"bitmask row {index} out of range")
        # A tensor resized in place (resize_) after its first fill would keep a stale address:
        # bitmask buffers are allocated once and never resized.
        self.native.unsafe_compute_mask_ptr(
            self._checked_ptr + index * self._row_bytes, self._row_bytes
        )
        self.mask_memo_stale = False
        # accept() never consumes a bad token, but a mask can hit a runtime limit (the lexer's
        # fuel, the parser's row limit): llguidance then writes an EOS-only row, which would end
        # the request early as if it were done. It is this request's error instead.
        if self.native.is_error():
            raise MatcherStateError(f"llguidance: {self.native.get_error()}")

    def _native_can_terminate(self) -> bool:
        return bool(self.native.is_accepting())

    def completes(self, tokens: Sequence[int]) -> bool:
        # llguidance validates a run without consuming it (a few us, where consuming it on a
        # fork costs ~20x that); a stop token after it is allowed exactly when it can end there
        if not tokens or not self.takes_all_natively(tokens):
            return super().completes(tokens)
        return self._validate([*tokens, self._eos]) == len(tokens) + 1

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        # ``validate_tokens`` counts what ``try_consume_tokens`` would take, consuming nothing
        # (where a fork costs a ``deep_copy`` and a new wrapper)
        if not tokens or not self.takes_all_natively(tokens):
            return super().accepted_prefix(tokens)
        return self._validate(list(tokens))

    def _validate(self, tokens: list[int]) -> int:
        """How many of ``tokens`` llguidance would consume (``validate_tokens``: none is)."""
        if self.mask_memo_stale:
            self.refresh_mask_memo()
        valid: int = self.native.validate_tokens(tokens)
        if self.native.is_error():
            raise MatcherStateError(f"llguidance: {self.native.get_error()}")
        return valid

    def _native_reset(self) -> None:
        self.native.reset()
        self.mask_memo_stale = False
        self.history.clear()
        self.twin = None
        self.closing_base = None

    def forced_tokens(self, limit: int) -> list[int]:
        if limit <= 0 or self.is_terminated():
            return []
        tokens: list[int] = self.native.compute_ff_tokens()
        return tokens[:limit]

    def native_closing(self, token: int | None, limit: int, keys: int = 0) -> LlgClosing | None:
        return closing_of(self, token, limit, keys)

    def prepare(self, scratch: torch.Tensor) -> None:
        """See ``GrammarMatcher.prepare``: the row, and the native walk's twin (a clone of the
        grammar's C-API template), which the first speculative step otherwise made on the
        engine thread (``tree_batch.takes``)."""
        super().prepare(scratch)
        twin_of(self)  # None while the grammar has no C-API template: the first walk makes it

    def fork(self) -> Matcher:
        other = Matcher(self.compiled, self.native.deep_copy())
        self._copy_state_to(other)
        other.mask_memo_stale = self.mask_memo_stale  # deep_copy copies the memo too
        other.history = list(self.history)  # its twin, if it is ever walked, replays them
        other.closing_base = self.closing_base
        other.origin = self
        return other

    def _tree_walks(self, tree: DraftTree, threads: int) -> tuple[Walker, Walker | None]:
        """The native walk, inline (it checks the budget between nodes, in C), on the trees it
        takes; else the Python walk, on a helper thread under a budget (``tree_walk.py``).
        ``threads`` > 1 lets the native walk share a big tree with a second thread."""
        walk = partial(walk_llguidance, threads=threads) if threads > 1 else walk_llguidance
        inline = native_walk_ready(self) and native_takes(self, tree)
        return walk, None if inline else walk_llguidance_py


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
            ids = tuple(self._tokenizer.encode(text))
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


def _invalid(kind: GrammarKind, message: str) -> InvalidGrammarError:
    line = column = None
    match = _LARK_LOCATION.search(message)
    # locations refer to the Lark text llguidance saw: the caller's own text only for LARK
    if match is not None and kind is GrammarKind.LARK:
        line, column = int(match.group(1)), int(match.group(2))
    return InvalidGrammarError(kind.value, message.strip(), line=line, column=column)
