"""Structural tags and reasoning on the real Gemma 3 tokenizer (262,144 ids): each backend that
claims them agrees with xgrammar, and the tag's inside is exact."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from espalier.constrained.backends import get_backend
from espalier.constrained.backends.common import BackendOptions
from tests.fixtures.structural_tags import CASES, mask_of, probe_texts, verdict

pytestmark = pytest.mark.model

OPTIONS = BackendOptions(xgrammar_memory_limit=0)


@pytest.mark.parametrize("case", ["tool_tags", "reasoning_json"])
def test_llguidance_agrees_with_xgrammar_on_gemma(case: str, gemma_tokenizer: Any) -> None:
    spec = CASES[case]()
    reference = get_backend("xgrammar", gemma_tokenizer, OPTIONS).compile(spec)
    other = get_backend("llguidance", gemma_tokenizer, OPTIONS).compile(spec)
    for text in probe_texts(seed=3, count=20):
        ids = gemma_tokenizer.encode(text)
        assert verdict(other, ids) == verdict(reference, ids), (case, text)
    for text in ['ok <tool=a>{"x": 1', 'why</think>{"x"']:
        ref_matcher, other_matcher = reference.matcher(), other.matcher()
        for token in gemma_tokenizer.encode(text):
            ours, theirs = mask_of(other_matcher), mask_of(ref_matcher)
            assert not (ours & ~theirs).any()
            # on Gemma every token is UTF-8 text or a byte-fallback piece: free text may differ
            # only on byte pieces that never form UTF-8
            differ = np.flatnonzero(ours != theirs)
            assert all(len(gemma_tokenizer.token_bytes[t]) == 1 for t in differ), text
            if not ref_matcher.accept(token):
                break
            assert other_matcher.accept(token)
