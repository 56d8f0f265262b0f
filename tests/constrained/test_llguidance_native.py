"""llguidance's C-API matchers and native tree walk (``constrained/backends/llguidance/native/``):
walks from the request's own matcher stay exact through accepts, rollbacks, resets and forks,
and never move it; the budget holds inline; lazy forks; an llguidance of another series is a
clear error."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import get_backend
from espalier.constrained.backends.common import BackendOptions
from espalier.constrained.backends.llguidance.native import capi as native
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.masks import fill_tree_bitmask
from tests.fixtures.tree_oracle import compare, replay_tree
from tests.fixtures.tree_random import grow_tree, sample_instance

NATIVE = BackendOptions()


SCHEMA = GrammarSpec.json_schema(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "n": {"type": "integer"},
        },
        "required": ["name"],
    }
)


def native_grammar(tokenizer: Any, spec: GrammarSpec = SCHEMA) -> Any:
    grammar = get_backend("llguidance", tokenizer, NATIVE).compile(spec)
    assert grammar.native_slot.wait(60) is not None, grammar.native_slot.error
    return grammar


def history_of(matcher: Any) -> list[int]:
    """The tokens ``matcher`` accepted natively (stop tokens excluded)."""
    return list(matcher.history)


def check_walk(
    grammar: Any, matcher: Any, rng: np.random.Generator, size: int, threads: int = 1
) -> list[str]:
    """Grow a tree at ``matcher``'s state, walk it natively, compare with the oracle."""
    prefix = history_of(matcher)
    body = sample_instance(matcher.fork(), rng, max_tokens=20)
    tree = grow_tree(grammar.matcher, prefix, body, size, rng)
    out = bm.allocate(tree.num_nodes, matcher.vocab_size, fill=-1)
    masks = fill_tree_bitmask(matcher, tree, out, budget=None, threads=threads)
    assert matcher.history == prefix  # the walk ran on clones, never on the request's matcher
    return compare(masks, out, tree, replay_tree(grammar.matcher, prefix, tree))


def helper_rows(matcher: Any) -> int:
    return int(matcher.helper_rows)


@pytest.mark.parametrize("threads", [1, 2])
def test_walks_follow_accepts_rollbacks_resets_and_forks(
    toy_tokenizer_padded: Any, threads: int
) -> None:
    """Walks from the request's own matcher, on one thread and on two (the second walks part
    of each tree): every row is exact across accepts, rollbacks, resets and forks."""
    grammar = native_grammar(toy_tokenizer_padded)
    rng = np.random.default_rng(5)
    stops = set(toy_tokenizer_padded.stop_token_ids)
    matcher = grammar.matcher()
    problems: list[str] = []
    helped = 0
    for step in range(40):
        before = helper_rows(matcher)
        problems += check_walk(grammar, matcher, rng, int(rng.choice([4, 16, 48])), threads)
        helped += helper_rows(matcher) - before
        action = step % 5
        if action in (0, 1):  # decode a few tokens, as after an accepted path
            for token in sample_instance(matcher.fork(), rng, max_tokens=int(rng.integers(1, 5))):
                if token in stops:
                    break
                assert matcher.accept(token)
        elif action == 2 and matcher.history:  # roll back, maybe below the closing base
            matcher.rollback(int(rng.integers(1, len(matcher.history) + 1)))
        elif action == 3:  # a fork walks from its own matcher; the original is untouched
            fork = matcher.fork()
            for token in sample_instance(fork.fork(), rng, max_tokens=3):
                if token in stops or not fork.accept(token):
                    break
            problems += check_walk(grammar, fork, rng, 16, threads)
        elif step % 10 == 4:
            matcher.reset()
            assert matcher.history == []
    assert problems == []
    if threads == 1:
        assert helped == 0  # no second thread: nobody else fills rows
        return
    # The second thread did fill rows. Whether it gets any in a given walk is the scheduler's
    # call (a loaded CI machine once left it none in 40): more walks until it does.
    for _ in range(200):
        if helped > 0:
            break
        before = helper_rows(matcher)
        problems += check_walk(grammar, matcher, rng, 48, threads)
        helped += helper_rows(matcher) - before
    assert problems == [] and helped > 0


def test_budget_prunes_inline_and_the_matcher_is_unchanged(toy_tokenizer: Any) -> None:
    grammar = native_grammar(toy_tokenizer)
    rng = np.random.default_rng(9)
    matcher = grammar.matcher()
    body = sample_instance(matcher.fork(), rng, max_tokens=24)
    tree = grow_tree(grammar.matcher, [], body, 200, rng)
    oracle = replay_tree(grammar.matcher, [], tree)
    out = bm.allocate(tree.num_nodes, matcher.vocab_size, fill=0)
    masks = fill_tree_bitmask(matcher, tree, out, budget=0.0)
    assert masks.budget_hit and not masks.abandoned  # inline: no helper, nothing left running
    assert masks.filled.tolist() == [True] + [False] * (tree.num_nodes - 1)
    assert compare(masks, out, tree, oracle) == []
    # a budget that stops the walk part way: every kept row exact, the rest pruned
    masks = fill_tree_bitmask(matcher, tree, out, budget=1e-4)
    assert compare(masks, out, tree, oracle) == []
    # and the matcher is still at the root: a full walk afterwards is exact
    masks = fill_tree_bitmask(matcher, tree, out, budget=None)
    assert not masks.budget_hit and masks.filled.sum() > 1
    assert compare(masks, out, tree, oracle) == []


def test_step_reuse_root_row_with_the_native_walk(toy_tokenizer: Any) -> None:
    """A given root row is trusted (``ROOT_READY``); rollbacks before it still refresh the memo."""
    grammar = native_grammar(toy_tokenizer, GrammarSpec.regex(r'\[("ab"|"abc")(,"ab")*\]'))
    rng = np.random.default_rng(3)
    matcher = grammar.matcher()
    problems: list[str] = []
    for _ in range(12):
        tree = grow_tree(
            grammar.matcher, history_of(matcher), sample_instance(matcher.fork(), rng, 12), 24, rng
        )
        root = bm.allocate(1, matcher.vocab_size, fill=0)
        matcher.fill_bitmask(root, 0)
        out = bm.allocate(tree.num_nodes, matcher.vocab_size, fill=-1)
        masks = fill_tree_bitmask(matcher, tree, out, budget=None, root_row=root[0])
        problems += compare(masks, out, tree, replay_tree(grammar.matcher, matcher.history, tree))
        path = [int(t) for t in tree.tokens[1:4] if t not in toy_tokenizer.stop_token_ids]
        accepted = 0
        for token in path:
            if not matcher.accept(token):
                break
            accepted += 1
        if accepted > 1:
            matcher.rollback(1)
    assert problems == []


def chain_tree(root: int, chain: list[int]) -> DraftTree:
    n = len(chain) + 1
    links = np.array([i + 1 if i + 1 < n else -1 for i in range(n)], dtype=np.int64)
    return DraftTree(np.array([root, *chain], dtype=np.int64), links, np.full(n, -1))


def test_walks_never_move_the_request(toy_tokenizer: Any) -> None:
    """A walk runs on clones: the request's matcher stays at its state (nothing is rolled back,
    see ``test_llguidance_stale_rollback``). Chains accepted in full, in part, and not at all
    all give exact masks."""
    grammar = native_grammar(toy_tokenizer)
    rng = np.random.default_rng(11)
    stops = set(toy_tokenizer.stop_token_ids)
    matcher = grammar.matcher()
    problems: list[str] = []
    root = 0
    for step in range(24):
        body = [t for t in sample_instance(matcher.fork(), rng, max_tokens=8) if t not in stops]
        if not body:
            break
        tree = chain_tree(root, body)
        out = bm.allocate(tree.num_nodes, matcher.vocab_size, fill=-1)
        masks = fill_tree_bitmask(matcher, tree, out, budget=None)
        history = list(matcher.history)
        problems += compare(masks, out, tree, replay_tree(grammar.matcher, history, tree))
        assert matcher.history == history  # the walk left it where the request is
        keep = [len(body), 0, len(body) // 2][step % 3]
        assert matcher.accept_tokens(body[:keep]) == keep
        if keep < len(body) and step % 2:  # diverge from the chain after the kept part
            other = sample_instance(matcher.fork(), rng, max_tokens=2)
            if other and other[0] not in stops:
                assert matcher.accept(other[0])
        root = matcher.history[-1] if matcher.history else 0
    assert problems == []


def test_tokenize_cache_answers_repeats_without_the_slow_tokenizer() -> None:
    lib = native.api()
    calls: list[bytes] = []

    def slow(_user: Any, data: Any, size: int, out: Any, capacity: int) -> int:
        text = ctypes.string_at(data, size)
        calls.append(text)
        ids = list(text)  # one id per byte: easy to check
        for i, token in enumerate(ids[:capacity]):
            out[i] = token
        return len(ids)

    callback = native._TokenizeFn(slow)
    cache = lib.tokenize_cache_new(ctypes.cast(callback, ctypes.c_void_p), None, 8)
    cached = ctypes.cast(lib.tokenize_cached, native._TokenizeFn)

    def tokenize(text: bytes, capacity: int) -> tuple[int, list[int]]:
        out = (ctypes.c_uint32 * max(capacity, 1))()
        data = (ctypes.c_uint8 * len(text)).from_buffer_copy(text)
        n = cached(cache, data, len(text), out, capacity)
        return n, list(out[: min(n, capacity)])

    long_text = bytes(range(1, 101))  # more ids than the cache's first buffer (64)
    assert tokenize(b"abc", 8) == (3, [97, 98, 99])
    assert tokenize(b"abc", 2) == (3, [97, 98])  # fewer than there are: count, truncated ids
    assert tokenize(long_text, 10) == (100, list(long_text[:10]))
    assert tokenize(long_text, 200) == (100, list(long_text))
    assert calls.count(b"abc") == 1
    assert calls.count(long_text) == 2  # once into 64 slots, once more with room for all 100
    for i in range(200):  # more texts than slots: the cache clears itself and stays right
        assert tokenize(b"t%d" % i, 8)[1] == list(b"t%d" % i)
    assert tokenize(b"abc", 8) == (3, [97, 98, 99])


WRONG_VERSION_PROBE = """
from espalier.constrained.backends import get_backend
from espalier.constrained.backends.llguidance.native.capi import NativeBuildError
from tests.fixtures.tokenizers import build_byte_level_hf
from espalier.constrained.tokenizer import TokenizerInfo

hf = build_byte_level_hf()
tokenizer = TokenizerInfo(hf, stop_token_ids=[hf.convert_tokens_to_ids("<eos>")], name="toy")
try:
    get_backend("llguidance", tokenizer)
except NativeBuildError as exc:
    print("ERROR:", exc)
else:
    print("NO ERROR")
"""


@pytest.mark.parametrize("fake", ["1.10.0", "2.0.1", "1.8.0"])
def test_a_wrong_llguidance_version_is_a_clear_error(tmp_path: Path, fake: str) -> None:
    """An llguidance of another series (its metadata, shadowing the real one on the path)
    stops the backend from being made, with an error that names both versions, before the
    library is called."""
    info = tmp_path / f"llguidance-{fake}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llguidance\nVersion: {fake}\n")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    run = subprocess.run(
        [sys.executable, "-c", WRONG_VERSION_PROBE],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout.strip().splitlines()[-1]
    assert out.startswith("ERROR: "), out
    assert f"llguidance {fake} is installed" in out
    assert f"llguidance {native.api().series()}.x" in out
    assert "llguidance<1.10,>=1.9.1" in out or "llguidance>=1.9.1,<1.10" in out  # the pin


def test_version_check_names_both_versions() -> None:
    native.check_version("1.9.7", "1.9")  # a patch release of the series: fine
    with pytest.raises(native.NativeBuildError, match=r"llguidance 1\.10\.0 is installed.*1\.9\.x"):
        native.check_version("1.10.0", "1.9")


def test_the_installed_llguidance_passes_the_load_checks() -> None:
    lib = native.api()  # version, then the layout probe of LlgConstraintInit
    assert lib.series() == ".".join(native.installed_llguidance().split(".")[:2])
    lib.check_layout()


def test_forks_are_lazy_and_exact(toy_tokenizer: Any) -> None:
    """A fork has no C-API matcher until it is used (a clone copies the lexer: most forks are
    only read natively or dropped); used, it is exactly its source's state, and its own."""
    backend = get_backend("llguidance", toy_tokenizer)
    assert backend.tree_walk(60) == "native"  # type: ignore[attr-defined]
    grammar = backend.compile(SCHEMA)
    rng = np.random.default_rng(2)
    matcher = grammar.matcher()
    body = [
        t for t in sample_instance(matcher.fork(), rng, 16) if t not in toy_tokenizer.stop_token_ids
    ]
    for token in body[: len(body) // 2]:
        assert matcher.accept(token)
    fork = matcher.fork()
    assert not fork.materialized and fork.history == matcher.history
    search = fork.native_closing(None, 0)  # a native search from the base, nothing made
    assert search is not None and not fork.materialized
    row_fork = bm.allocate(1, matcher.vocab_size, fill=0)
    row_matcher = bm.allocate(1, matcher.vocab_size, fill=0)
    fork.fill_bitmask(row_fork, 0)
    matcher.fill_bitmask(row_matcher, 0)
    assert fork.materialized and fork.native.pointer != matcher.native.pointer
    assert np.array_equal(row_fork.numpy(), row_matcher.numpy())
    rest = body[len(body) // 2 :]
    assert fork.accept_tokens(rest) == len(rest)
    assert matcher.history == body[: len(body) // 2]  # the source did not move
    tree = grow_tree(grammar.matcher, fork.history, [], 8, rng)
    out = bm.allocate(tree.num_nodes, matcher.vocab_size, fill=0)
    masks = fill_tree_bitmask(fork, tree, out, budget=None)
    assert compare(masks, out, tree, replay_tree(grammar.matcher, fork.history, tree)) == []


def test_a_dropped_matcher_is_freed_on_the_releaser_thread(
    toy_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collected :class:`NativeMatcher` is freed by its library's free, on the releaser's
    thread, not on the one that dropped it; a forked child starts a releaser thread of its own
    (the parent's is not there)."""
    import gc
    import threading

    compiled = get_backend("llguidance", toy_tokenizer).compile(GrammarSpec.regex("[ab]{1,8}"))
    source = compiled.matcher().native
    freed: list[tuple[int, str]] = []
    done = threading.Event()
    release = native.RELEASER.free

    def recording(function: Any, pointer: int) -> None:
        def free(p: int) -> None:
            function(p)
            freed.append((p, threading.current_thread().name))
            done.set()

        release(free, pointer)

    monkeypatch.setattr(native.RELEASER, "free", recording)
    clone = source.clone()  # its finalizer takes the recording free
    pointer = clone.pointer
    del clone
    gc.collect()
    assert done.wait(10)
    assert freed == [(pointer, "espalier-llg-free")]
    assert threading.current_thread().name != "espalier-llg-free"
    assert source.validate(toy_tokenizer.encode("a")) == 1  # its source lives on
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        child = threading.Event()
        release(lambda _p: child.set(), 0)
        os.write(write, b"1" if child.wait(10) else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
