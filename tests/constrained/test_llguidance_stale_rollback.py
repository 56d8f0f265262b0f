"""llguidance 1.9.1 can answer a mask from a rolled-back branch, and our default walk is exact.

Found by the tree oracle on a JSONSchemaBench tree (BFCL_java/BFCL_java_56, Gemma tokenizer):
inside the key ``"parserConfig``, masking after ``":["*`` (a string in an array), rolling back
two tokens, masking at the key again and consuming ``":{"`` (a string in an object) gives the
array string's mask (``",`` and ``"]`` allowed, ``":`` forbidden). A mask computed at the
rolled-back state does not repair it, so no walk rolls back: the native walk starts siblings
from fresh clones of the request's matcher, which it never moves (it rolled one matcher back and
refreshed the memo before: that walk failed here).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import get_backend
from espalier.constrained.backends.common import BackendOptions
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.masks import fill_tree_bitmask
from tests.fixtures.tree_oracle import compare, replay_tree

SCHEMA = {
    "type": "object",
    "properties": {
        "CCSDuelIT.parseEntity": {
            "type": "object",
            "properties": {"entity": {}, "entityParser": {}, "parserConfig": {}},
            "required": ["entity", "entityParser", "parserConfig"],
            "additionalProperties": False,
        }
    },
    "required": ["CCSDuelIT.parseEntity"],
    "additionalProperties": False,
}
PREFIX = '{"CCSDuelIT.parseEntity": {"entity": "httpResponseEntity", "entityParser": "response'
KEY = 'Parser", "parserConfig'  # the tree's root: inside that key
ARRAY_STRING = ['":[', '"*']  # a branch: the key's value is an array, a string in it
OBJECT_KEY = '":{"'  # its sibling: the value is an object, a key string in it


def token(tokenizer: Any, text: str) -> int:
    ids: list[int] = tokenizer.encode(text)
    assert len(ids) == 1, f"{text!r} is {len(ids)} Gemma tokens"
    return ids[0]


def mask(native: Any, words: int) -> np.ndarray:
    row = np.zeros(words, dtype=np.int32)
    native.mask_into(row)
    return row


def test_a_rollback_can_leave_a_stale_mask(gemma_tokenizer: Any) -> None:
    """The library behaviour the walks avoid. If this starts failing, llguidance fixed its
    rollback: walks may roll back again (cheaper than clones; rerun the tree oracle)."""
    grammar = get_backend("llguidance", gemma_tokenizer).compile(GrammarSpec.json_schema(SCHEMA))
    words = bm.words_per_row(gemma_tokenizer.vocab_size)
    start = gemma_tokenizer.encode(PREFIX) + gemma_tokenizer.encode(KEY)
    branch = [token(gemma_tokenizer, t) for t in ARRAY_STRING]
    sibling = token(gemma_tokenizer, OBJECT_KEY)

    fresh = grammar.matcher()
    assert fresh.accept_tokens([*start, sibling]) == len(start) + 1
    want = mask(fresh.native, words)

    walked = grammar.matcher()
    assert walked.accept_tokens(start) == len(start)
    native = walked.native.clone()
    assert native.try_consume(branch) == len(branch)
    mask(native, words)  # a mask down the branch...
    assert native.rollback(len(branch))
    mask(native, words)  # ...a fresh one back at the key (what a memo refresh does)...
    assert native.try_consume([sibling]) == 1
    stale = mask(native, words)  # ...and the sibling still gets the branch's mask
    assert not np.array_equal(stale, want)
    assert bm.is_allowed(want, token(gemma_tokenizer, '":'))
    assert not bm.is_allowed(stale, token(gemma_tokenizer, '":'))


def tree(tokenizer: Any) -> DraftTree:
    """root (at the key) -> ``":[`` -> ``"*``, and root -> ``":{"``: the DFS visits the array
    branch first, then rolls back to the root for the object sibling."""
    tokens = [token(tokenizer, "Config"), *[token(tokenizer, t) for t in ARRAY_STRING]]
    tokens.append(token(tokenizer, OBJECT_KEY))
    return DraftTree(
        np.array(tokens, dtype=np.int64),
        np.array([1, 2, -1, -1], dtype=np.int64),
        np.array([-1, 3, -1, -1], dtype=np.int64),
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_tree_masks_on_that_tree(gemma_tokenizer: Any, threads: int) -> None:
    """The walk is exact on it, on one thread and on two."""
    backend = get_backend("llguidance", gemma_tokenizer, BackendOptions())
    grammar = backend.compile(GrammarSpec.json_schema(SCHEMA))
    prefix = gemma_tokenizer.encode(PREFIX) + gemma_tokenizer.encode(KEY[: -len("Config")])
    draft = tree(gemma_tokenizer)
    matcher = grammar.matcher()
    assert matcher.accept_tokens([*prefix, int(draft.tokens[0])]) == len(prefix) + 1
    out = bm.allocate(draft.num_nodes, matcher.vocab_size, fill=-1)
    masks = fill_tree_bitmask(matcher, draft, out, budget=None, threads=threads)
    assert masks.valid.all()  # every path is grammar-valid: each row is compared
    oracle = replay_tree(grammar.matcher, [*prefix, int(draft.tokens[0])], draft)
    problems = compare(masks, out, draft, oracle)
    assert matcher.history == [*prefix, int(draft.tokens[0])]  # the walk ran on clones
    assert problems == []
