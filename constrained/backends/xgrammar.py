"""The xgrammar adapter: every grammar kind, compiled by ``xgrammar.GrammarCompiler``.

- JSON_SCHEMA / ANY_JSON (any JSON value, schema ``{}``): ``compile_json_schema`` with
  whitespace bounded by ``BackendOptions.json_max_whitespace`` (``max_whitespace_cnt``) and
  ``strict_mode`` from ``BackendOptions.json_strict_properties``; numbers bounded by
  ``BackendOptions.json_number_bounds`` (``constrained/number_bounds.py``).
- REGEX: ``compile_regex``; EBNF (GBNF): ``compile_grammar`` with root rule ``root``;
  LARK: ``compile_lark``; CHOICE: a GBNF alternation of escaped string literals.

The vocabulary is given to xgrammar as raw bytes with special tokens (stops included) as empty
strings, so xgrammar never matches a control token as text; stop tokens are passed separately.
"""

from __future__ import annotations

import re
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
from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.spec import GrammarKind, GrammarSpec

if TYPE_CHECKING:
    from espalier.constrained.tokenizer import TokenizerInfo

NAME = "xgrammar"
_LOCATION = re.compile(r"line (\d+), column (\d+)")
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: ")


class Backend:
    """xgrammar bound to one tokenizer; ``compile`` is thread-safe."""

    name = NAME
    kinds = frozenset(GrammarKind)

    def __init__(self, tokenizer: TokenizerInfo, options: BackendOptions) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.facts = vocab_facts(tokenizer)
        facts = self.facts  # backend_view holds the tokenizer's lock: build without re-entering
        self.tokenizer_info = tokenizer.backend_view(
            "xgrammar", lambda tok: _build_tokenizer_info(tok, facts)
        )
        self.compiler = xgrammar.GrammarCompiler(
            self.tokenizer_info, max_threads=options.max_threads, cache_enabled=False
        )

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            native = self._compile_native(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _invalid(spec.kind, exc) from exc
        return CompiledGrammar(spec, self.tokenizer, self.facts, native)

    def _compile_native(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        kind = spec.kind
        if kind in (GrammarKind.JSON_SCHEMA, GrammarKind.ANY_JSON):
            ws = self.options.json_max_whitespace
            return self.compiler.compile_json_schema(
                self.options.json_source(spec, NAME) if kind is GrammarKind.JSON_SCHEMA else "{}",
                any_whitespace=ws > 0,
                max_whitespace_cnt=ws if ws > 0 else None,
                separators=None if ws > 0 else (",", ":"),
                strict_mode=self.options.json_strict_properties,
            )
        if kind is GrammarKind.REGEX:
            return self.compiler.compile_regex(spec.source)
        if kind is GrammarKind.EBNF:
            return self.compiler.compile_grammar(spec.source, root_rule_name="root")
        if kind is GrammarKind.LARK:
            return self.compiler.compile_lark(spec.source)
        assert kind is GrammarKind.CHOICE
        options = " | ".join(gbnf_literal(option) for option in spec.choices)
        return self.compiler.compile_grammar(f"root ::= {options}", root_rule_name="root")


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


class Matcher(MatcherBase):
    """Per-request state; ``native`` is the ``xgrammar.GrammarMatcher``."""

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


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF double-quoted string literal (control characters as ``\\xHH``)."""
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
            out.append(f"\\x{ord(char):02X}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


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


def _invalid(kind: GrammarKind, exc: Exception) -> InvalidGrammarError:
    message = str(exc).strip()
    message = _LOG_PREFIX.sub("", message.splitlines()[0] if message else type(exc).__name__)
    line = column = None
    match = _LOCATION.search(message)
    if match is not None and kind in (GrammarKind.EBNF, GrammarKind.LARK):
        line, column = int(match.group(1)), int(match.group(2))
    return InvalidGrammarError(kind.value, message, line=line, column=column)
