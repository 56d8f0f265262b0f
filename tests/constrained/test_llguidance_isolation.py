"""One request must not spend another's grammar (issue 39): llguidance matchers of one cached
grammar each have their own lexer, so a request that drives the lexer into its limit leaves the
next request on the same cached schema accepting exactly what a fresh compile accepts.

The schema is the shape found on JSONSchemaBench (Github_hard/o21074 and others): a word-count
pattern next to a ``maxLength``, whose lexer (pattern ∩ length) llguidance builds lazily and
expensively. With the byte-level toy tokenizer one mask after a few characters costs more than
llguidance's per-mask lexer fuel (``too many expressions constructed``).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.backends.llguidance import MatcherStateError
from espalier.constrained.cache import CacheKey, CompileCache
from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "q": {"type": "string", "maxLength": 1000, "pattern": "^(?:\\S+\\s+){0,99}\\S+$"}
    },
    "required": ["q"],
    "additionalProperties": False,
}
TEXTS = [
    json.dumps({"q": "w0"}),
    json.dumps({"q": "w1 w2\tw3"}),
    json.dumps({"q": " ".join(f"w{i}xy" for i in range(120))}),  # 120 words: invalid
    json.dumps({"q": " lead"}),  # invalid: starts with a space
    json.dumps({"q": 3}),
]


def accepted_prefixes(compiled: Any, tokenizer: Any) -> list[tuple[int, bool]]:
    """Per text: how many tokens a new matcher accepts, and whether it may then stop."""
    out = []
    for text in TEXTS:
        matcher = compiled.matcher()
        ids = tokenizer.encode(text)
        count = matcher.accept_tokens(ids)
        out.append((count, count == len(ids) and matcher.can_terminate()))
    return out


def exhaust(compiled: Any, tokenizer: Any) -> None:
    """A request that masks every step while writing a long string: its lexer gives up."""
    matcher = compiled.matcher()
    row = torch.zeros((1, bm.words_per_row(tokenizer.vocab_size)), dtype=torch.int32)
    for token in tokenizer.encode(json.dumps({"q": "w1 w2 w3 w4 w5 w6"})):
        try:
            matcher.fill_bitmask(row, 0)
        except MatcherStateError as exc:
            assert "too many expressions" in str(exc)
            return
        assert matcher.accept(token)
    raise AssertionError("the lexer never reached its limit: the test exercises nothing")


def test_a_request_that_exhausts_the_lexer_leaves_the_next_one_alone(toy_tokenizer: Any) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    cache = CompileCache(workers=1)
    key = CacheKey(spec.cache_key, "llguidance", toy_tokenizer.fingerprint, ("strict",))

    def compile_once() -> Any:
        return compile_grammar(spec, toy_tokenizer, "llguidance")

    try:
        cached, _ = cache.get(key, compile_once)
        exhaust(cached, toy_tokenizer)
        again, _ = cache.get(key, compile_once)
        assert again is cached  # the same cached grammar serves the second request
        fresh, _ = compile_once()
        expected = accepted_prefixes(fresh, toy_tokenizer)
        assert expected[0][1] and expected[1][1]  # the short valid texts are accepted
        assert not expected[2][1] and not expected[3][1] and not expected[4][1]
        assert accepted_prefixes(again, toy_tokenizer) == expected
        # and its first mask is the fresh compile's
        rows = torch.zeros((2, bm.words_per_row(toy_tokenizer.vocab_size)), dtype=torch.int32)
        again.matcher().fill_bitmask(rows, 0)
        fresh.matcher().fill_bitmask(rows, 1)
        assert torch.equal(rows[0], rows[1])
    finally:
        cache.close()


def test_a_mask_that_hits_a_runtime_limit_is_an_error_not_an_end(toy_tokenizer: Any) -> None:
    # llguidance answers such a mask with an EOS-only row: taken as is, the request would stop
    # early and look finished. The matcher raises instead (a per-request error).
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), toy_tokenizer, "llguidance")
    exhaust(compiled, toy_tokenizer)
