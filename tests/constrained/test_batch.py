"""One batch grammar call per step (``constrained/batch.py``): rows equal to one-by-one fills.

The Gemma vocabulary (262,144 ids, a multiple of 32) takes the libraries' batch entry points
(llguidance's ``LLExecutor``, xgrammar's ``BatchGrammarMatcher``); matchers at many states, a
terminated one, rows in any order, and a matcher that llguidance left in its error state (only
that row is reported, and it allows everything).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import get_backend
from espalier.constrained.backends.llguidance import MatcherStateError
from espalier.constrained.batch import BatchFiller
from espalier.constrained.fill_cost import FillCosts
from espalier.constrained.spec import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["name", "tags"],
}
INSTANCE = json.dumps({"name": "espalier tree", "tags": [1, 22, 333]})


def _matchers(tokenizer: Any, backend: str) -> list[Any]:
    compiled = get_backend(backend, tokenizer).compile(GrammarSpec.json_schema(SCHEMA))
    tokens = tokenizer.encode(INSTANCE)
    matchers = []
    for cut in range(0, len(tokens) + 1, 2):
        matcher = compiled.matcher()
        assert matcher.accept_tokens(tokens[:cut]) == cut
        matchers.append(matcher)
    ended = compiled.matcher()
    assert ended.accept_tokens([*tokens, tokenizer.stop_token_ids[0]]) == len(tokens) + 1
    assert ended.is_terminated()
    return [*matchers, ended]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("threads", [1, 3])
def test_batch_rows_equal_one_by_one_fills(
    gemma_tokenizer: Any, backend: str, threads: int
) -> None:
    matchers = _matchers(gemma_tokenizer, backend)
    n = len(matchers)
    rows = list(torch.randperm(n + 3, generator=torch.Generator().manual_seed(1))[:n].tolist())
    expected = bm.allocate(n + 3, gemma_tokenizer.vocab_size, fill=0)
    for matcher, row in zip(matchers, rows):
        matcher.fill_bitmask(expected, row)
    got = bm.allocate(n + 3, gemma_tokenizer.vocab_size, fill=0x5EA)
    faults = BatchFiller(threads).fill_next_rows(matchers, got, rows)
    assert faults == {}
    assert torch.equal(got[rows], expected[rows])
    assert len({tuple(expected[r, :64].tolist()) for r in rows}) > 3  # the states do differ


def test_a_matcher_in_llguidance_error_state_is_its_own_fault(gemma_tokenizer: Any) -> None:
    good = _matchers(gemma_tokenizer, "llguidance")
    many = [f"option-{i:04d}" for i in range(2001)]
    bad = get_backend("llguidance", gemma_tokenizer).compile(GrammarSpec.choice(many)).matcher()
    with pytest.raises(MatcherStateError):
        bad.accept(gemma_tokenizer.encode("option")[0])
    matchers = [good[0], bad, *good[1:]]
    rows = list(range(len(matchers)))
    expected = bm.allocate(len(matchers), gemma_tokenizer.vocab_size, fill=0)
    for row, matcher in enumerate(good):
        matcher.fill_bitmask(expected, row if row == 0 else row + 1)
    got = bm.allocate(len(matchers), gemma_tokenizer.vocab_size, fill=0)
    faults = BatchFiller(2).fill_next_rows(matchers, got, rows)
    assert list(faults) == [1] and isinstance(faults[1], MatcherStateError)
    assert bool((got[1] == -1).all())  # the faulty request's row allows everything
    keep = [r for r in rows if r != 1]
    assert torch.equal(got[keep], expected[keep])


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_batch_accepts_equal_one_by_one_accepts(gemma_tokenizer: Any, backend: str) -> None:
    """``accept_runs`` advances each matcher as its own ``accept_tokens`` would: runs of every
    length, one rejected midway, one through a stop token, an empty one, a terminated matcher;
    counts, then the states (their next rows) equal those of forks accepting one by one."""
    matchers = _matchers(gemma_tokenizer, backend)
    tokens = gemma_tokenizer.encode(INSTANCE)
    stop = gemma_tokenizer.stop_token_ids[0]
    bad = gemma_tokenizer.encode("}")[0]
    runs: list[list[int]] = []
    for j in range(len(matchers) - 1):
        cut = 2 * j
        rest = tokens[cut:]
        if j % 3 == 0:
            runs.append(rest[: 1 + j % 5])
        elif j % 3 == 1 and rest:
            runs.append([*rest[:1], bad, *rest[1:3]])  # rejected after one (or at once)
        else:
            runs.append([*rest, stop] if j % 2 else [])
    runs.append(tokens[:2])  # the terminated matcher rejects them
    forks = [m.fork() for m in matchers]
    expected = [f.accept_tokens(run) for f, run in zip(forks, runs)]
    counts, faults = BatchFiller(2).accept_runs(matchers, runs)
    assert faults == {}
    assert counts == expected
    assert 0 < sum(c < len(r) for c, r in zip(counts, runs)) < len(runs)  # some rejected
    n = len(matchers)
    got = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0)
    want = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0)
    for j, (matcher, fork) in enumerate(zip(matchers, forks)):
        assert matcher.is_terminated() == fork.is_terminated()
        matcher.fill_bitmask(got, j)
        fork.fill_bitmask(want, j)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_forks_caught_up_in_a_batch_equal_forks_caught_up_one_by_one(
    gemma_tokenizer: Any, backend: str
) -> None:
    """Fresh forks accept a batch's runs (the forced chains' catch-up, ``forced.caught_up``;
    llguidance makes their clones in the same native call) as forks accepting one by one do:
    counts and next rows, with runs rejected midway and two forks of one matcher in the batch;
    their matchers keep their state and advance apart from them afterwards."""
    matchers = _matchers(gemma_tokenizer, backend)[:-1]
    tokens = gemma_tokenizer.encode(INSTANCE)
    bad = gemma_tokenizer.encode("}")[0]
    runs = []
    for j in range(len(matchers)):
        rest = tokens[2 * j : 2 * j + 5]
        runs.append([*rest[:2], bad, *rest[2:]] if j % 3 == 1 and rest else rest)
    runs.append(tokens[:3])  # a second fork of the first matcher
    sources = [*matchers, matchers[0]]
    n = len(sources)
    before = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0)
    for j, matcher in enumerate(sources):
        matcher.fill_bitmask(before, j)
    alone = [m.fork() for m in sources]
    expected = [f.accept_tokens(run) for f, run in zip(alone, runs)]
    forks = [m.fork() for m in sources]
    counts, faults = BatchFiller(4).accept_runs(forks, runs)
    assert faults == {}
    assert counts == expected
    assert 0 < sum(c < len(r) for c, r in zip(counts, runs)) < n  # some rejected
    if backend == "llguidance":
        assert all(f.materialized for f, run in zip(forks, runs) if run)
    got = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0)
    want = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0)
    after = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0)
    for j, (fork, one, matcher) in enumerate(zip(forks, alone, sources)):
        fork.fill_bitmask(got, j)
        one.fill_bitmask(want, j)
        matcher.fill_bitmask(after, j)
    assert torch.equal(got, want)
    assert torch.equal(after, before)  # the matchers did not move
    assert not torch.equal(got, before)
    first = matchers[0]
    assert first.accept_tokens(tokens[:1]) == 1  # the matcher goes on; its forks stay
    check = bm.allocate(1, gemma_tokenizer.vocab_size, fill=0)
    forks[-1].fill_bitmask(check, 0)
    assert torch.equal(check[0], want[n - 1])


def test_a_batch_accept_that_raises_is_its_matchers_fault(gemma_tokenizer: Any) -> None:
    good = _matchers(gemma_tokenizer, "llguidance")[:3]
    many = [f"option-{i:04d}" for i in range(2001)]
    bad = get_backend("llguidance", gemma_tokenizer).compile(GrammarSpec.choice(many)).matcher()
    run = gemma_tokenizer.encode("option")
    tokens = gemma_tokenizer.encode(INSTANCE)
    runs = [tokens[0:2], run, tokens[2:3], tokens[4:6]]
    counts, faults = BatchFiller(2).accept_runs([good[0], bad, good[1], good[2]], runs)
    assert list(faults) == [1] and isinstance(faults[1], MatcherStateError)
    assert [counts[0], counts[2], counts[3]] == [2, 1, 2]


FREE = {"type": "object", "additionalProperties": {"type": "integer"}}


def test_tracked_batch_accepts_equal_one_by_one_accepts(gemma_tokenizer: Any) -> None:
    """Matchers wrapped by the duplicate-key tracker (``constrained/keys/``) accept a batch's
    runs through their source's batch call, then the tracker settles: counts and states equal
    each matcher's own ``accept_tokens``, with runs that stop at a repeated key, that the
    grammar rejects midway, that are whole, empty, or start at a repeated key."""
    from espalier.constrained.keys import UniqueKeysMatcher, with_unique_keys

    spec = GrammarSpec.json_schema(FREE)
    compiled = get_backend("llguidance", gemma_tokenizer).compile(spec)
    encode = gemma_tokenizer.encode
    texts = [
        ('{"a": 1, ', '"b": 2, "a": 3}'),  # the repeated key "a" ends the run
        ("{", '"a": 1, "b": 2}'),  # whole
        ('{"a": 1, ', '"c": x'),  # rejected by the grammar at "x"
        ('{"a": 1, "b', '": 2, "c": 3}'),
        ('{"a": 1, ', ""),  # nothing to accept
        ('{"a": 1, ', '"a'),  # a repeated key at once
        ('{"b": 4, ', '"c": 5, "d": 6, "e'),
    ]
    matchers: list[Any] = []
    runs: list[list[int]] = []
    for before, after in texts:
        matcher = with_unique_keys(spec, compiled.matcher(), gemma_tokenizer)
        assert isinstance(matcher, UniqueKeysMatcher)
        head = encode(before)
        assert matcher.accept_tokens(head) == len(head)
        matchers.append(matcher)
        runs.append(encode(after) if after else [])
    forks = [m.fork() for m in matchers]
    expected = [f.accept_tokens(run) for f, run in zip(forks, runs)]
    counts, faults = BatchFiller(2).accept_runs(matchers, runs)
    assert faults == {}
    assert counts == expected
    assert 0 < sum(c < len(r) for c, r in zip(counts, runs)) < len(runs)  # some stop early
    n = len(matchers)
    got = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0)
    want = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0)
    for j, (matcher, fork) in enumerate(zip(matchers, forks)):
        assert matcher.keys.export() == fork.keys.export()
        matcher.fill_bitmask(got, j)
        fork.fill_bitmask(want, j)
    assert torch.equal(got, want)


ONLY_A = {
    "type": "object",
    "patternProperties": {"^a$": {"type": "integer"}},
    "additionalProperties": False,
}


def test_tracked_batch_accepts_stop_at_a_dead_end_duplicate(gemma_tokenizer: Any) -> None:
    """Only key "a" exists: after ``{"a": 1,`` every way on repeats it, so the tracker keeps
    the row (never emptied) but refuses the duplicate. The batch accept takes as many tokens as
    accepting them one at a time does (none past the duplicate), and leaves the same states."""
    from espalier.constrained.keys import with_unique_keys

    spec = GrammarSpec.json_schema(ONLY_A)
    compiled = get_backend("llguidance", gemma_tokenizer).compile(spec)
    head = gemma_tokenizer.encode('{"a": 1, ')
    runs = [gemma_tokenizer.encode(text) for text in ('"a": 2}', '"a": 2, "a": 3}', '"a": x')]
    batched, single = [], []
    for _ in runs:
        for group in (batched, single):
            matcher = with_unique_keys(spec, compiled.matcher(), gemma_tokenizer)
            assert matcher.accept_tokens(head) == len(head)
            group.append(matcher)
    expected = []
    for matcher, run in zip(single, runs):
        count = 0
        while count < len(run) and matcher.accept(run[count]):
            count += 1
        expected.append(count)
        accepted = gemma_tokenizer.decode(list(head) + list(run[:count]))
        assert accepted.replace(" ", "").count('"a"') == 1, accepted  # never the duplicate
        refusal = matcher.refusal()
        assert refusal is not None and refusal.startswith("duplicate key"), refusal
    counts, faults = BatchFiller(2).accept_runs(batched, runs)
    assert faults == {}
    assert counts == expected
    for a, b in zip(batched, single):
        assert a.keys.export() == b.keys.export()
        assert a.is_terminated() == b.is_terminated()


class _MeetingNative:
    """Delegates to ``inner``; its mask fill first waits at ``barrier``: the fills of the
    matchers sharing it go on only once all of them are running at the same time."""

    def __init__(self, inner: Any, barrier: threading.Barrier) -> None:
        self._inner, self._barrier = inner, barrier

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name != "fill_next_token_bitmask":
            return attr

        def call(*args: Any) -> Any:
            self._barrier.wait(10.0)
            return attr(*args)

        return call


def test_matchers_known_to_be_slow_are_filled_at_once_each_within_its_limit(
    toy_tokenizer: Any,
) -> None:
    """Matchers with a debt are filled on helper threads, each waited for until its limit
    (``fill_cost.FillCosts.limit``). Their waits overlap: three fills that can only finish
    together (a barrier of three) finish, exact; waited for one after the other, the first
    would have been abandoned at its limit, and the others with it."""
    compiled = get_backend("xgrammar", toy_tokenizer).compile(GrammarSpec.json_schema(SCHEMA))
    barrier = threading.Barrier(3)
    matchers = []
    for _ in range(3):
        matcher = compiled.matcher()
        matcher.native = _MeetingNative(matcher.native, barrier)
        matchers.append(matcher)
    costs = FillCosts(slow_s=0.05, debt_s=1.0)
    for matcher in matchers:
        assert costs.charge(matcher, 0.06) is None  # a debt: its fills go aside, bounded
    expected = bm.allocate(1, toy_tokenizer.vocab_size, fill=0)
    compiled.matcher().fill_bitmask(expected, 0)
    bitmask = bm.allocate(4, toy_tokenizer.vocab_size, fill=0)
    faults = BatchFiller(2, costs).fill_next_rows(matchers, bitmask, [3, 0, 2])
    assert faults == {}
    assert not barrier.broken
    for row in (3, 0, 2):
        assert torch.equal(bitmask[row], expected[0])
    assert not bitmask[1].any()
