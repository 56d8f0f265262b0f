"""Do grammar masks get faster on 2 threads? Per way of calling them, 1 vs 2 threads, JSON lines.

Issue 3 asks for 32 trees filled on 2 threads >= 1.7x faster than on 1. The fills drop the GIL
only inside library calls, so what two threads gain depends on how long each call runs without
it. Measured here on the same work split two ways: each thread owns the matchers of its own
schemas (JSONSchemaBench, states along a valid instance), and the run on one thread does both
halves one after the other. Per line: microseconds per mask (or tree) on one thread and the
speedup of two threads (best of ``--repeat``):

- anchors, what this machine gives two threads that drop the GIL: ``anchor_hash`` (SHA-256 of
  4 MiB: compute-bound), ``anchor_copy_cache`` (numpy copies of 256 KiB arrays: cache-resident)
  and ``anchor_copy_dram`` (32 MiB arrays: memory-bound; on the 2-core CI-like machine the copies
  scaled anywhere from 0.9x to 1.9x between runs);
- one mask per call from Python: ``llguidance_c_api`` (``llg_matcher_compute_mask_into``
  through ctypes), ``llguidance_python`` (``LLMatcher.unsafe_compute_mask_ptr``: the Python
  tree walk's mask) and ``xgrammar`` (our matcher's ``fill_bitmask``). A call of a few µs
  drops the GIL only for itself: the threads then queue for it between calls;
- ``llguidance_native_walk``: a 12-node chain per call through the native tree walk
  (``constrained/backends/llguidance/native/``, the GIL dropped for the whole tree): the way our
  fills call it;
- ``llguidance_executor``: llguidance's own parallel ``LLExecutor`` on all the states at once,
  2 threads against 1;
- ``gil``: per ``LLMatcher`` call the closing decisions and the Python walk make, its time
  alone and with a busy pure-Python thread alongside (``spinner_us``). A call that drops the
  GIL (the mask) then waits for the other thread to give it back, up to a switch interval
  (5 ms): the convoy that makes µs-scale GIL-dropping calls expensive next to Python work.

The last line is a summary. ``python bench/mask_threads.py [--data .data/jsonschemabench]
[--schemas 8] [--states 8] [--rounds 60] [--repeat 5] [--tokenizer DIR]``
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import repo_root  # noqa: F401  (bench/repo_root.py: tests.fixtures importable)
from masks import sample_files  # bench/masks.py (this folder is on sys.path)

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import get_backend
from espalier.constrained.backends.llguidance.tree_walk import walk_llguidance
from espalier.constrained.compile import prepare_schema
from espalier.constrained.errors import GrammarError
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.tokenizer import TokenizerInfo
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.masks import fill_tree_bitmask
from espalier.server.default_model import default_tokenizer
from tests.fixtures.tree_random import sample_instance

Work = Callable[[int], None]
"""``work(rounds)``: one thread's share, ``rounds`` times over."""


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def speedup(halves: Sequence[Work], rounds: int, repeat: int) -> tuple[float, float]:
    """Best-of-``repeat`` seconds of both halves on one thread, and on two threads at once."""
    one = two = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for half in halves:
            half(rounds)
        one = min(one, time.perf_counter() - start)
        threads = [threading.Thread(target=half, args=(rounds,)) for half in halves]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        two = min(two, time.perf_counter() - start)
    return one, two


def grammars(
    backend: str, files: list[Path], tokenizer: TokenizerInfo, states: int
) -> list[tuple[Any, list[int]]]:
    """``(compiled grammar, a valid instance's first tokens)`` per schema that compiles."""
    engine = get_backend(backend, tokenizer)
    stops = set(tokenizer.stop_token_ids)
    out = []
    for path in files:
        try:
            prepared = prepare_schema(json.loads(path.read_text())["schema"]).schema
            compiled = engine.compile(GrammarSpec.json_schema(prepared, max_bytes=1 << 30))
        except (GrammarError, ValueError, RecursionError):
            continue
        rng = np.random.default_rng(len(out))
        body = [t for t in sample_instance(compiled.matcher(), rng, 4 * states) if t not in stops]
        if len(body) >= states:
            out.append((compiled, body[:states]))
    return out


def split(items: list[Any]) -> tuple[list[Any], list[Any]]:
    return items[0::2], items[1::2]


def llguidance_c_api(loaded: list[tuple[Any, list[int]]], words: int) -> list[Work]:
    """Per thread: C-API matchers at each state of its schemas, masks through ctypes."""
    halves: list[Work] = []
    for part in split(loaded):
        natives = []
        for compiled, body in part:
            if compiled.native_slot is None or compiled.native_slot.wait(120) is None:
                continue
            for k in range(len(body)):
                native = compiled.native_start()
                tokens = (ctypes.c_uint32 * max(k, 1))(*body[:k])
                native.tokenizer.api.llg.llg_matcher_consume_tokens(native.pointer, tokens, k)
                natives.append(native)
        row = np.zeros(words, dtype=np.int32)

        def work(rounds: int, natives: list[Any] = natives, row: np.ndarray = row) -> None:
            for _ in range(rounds):
                for native in natives:
                    native.mask_into(row)

        halves.append(work)
    return halves


def python_matchers(part: list[tuple[Any, list[int]]]) -> list[Any]:
    """Our matchers at each state of ``part``'s schemas."""
    matchers = []
    for compiled, body in part:
        for k in range(len(body)):
            matcher = compiled.matcher()
            assert matcher.accept_tokens(body[:k]) == k
            matchers.append(matcher)
    return matchers


def pyo3_matchers(part: list[tuple[Any, list[int]]]) -> list[Any]:
    """llguidance's Python ``LLMatcher`` at each state of ``part``'s schemas (its Python API,
    beside the C API that espalier's matchers use), made from each grammar's text."""
    import llguidance

    from espalier.constrained.backends import get_backend

    matchers = []
    for compiled, body in part:
        lltokenizer = get_backend("llguidance", compiled.tokenizer).lltokenizer  # type: ignore[attr-defined]
        for k in range(len(body)):
            matcher = llguidance.LLMatcher(lltokenizer, compiled.grammar, log_level=0)
            assert matcher.try_consume_tokens(body[:k]) == k
            matchers.append(matcher)
    return matchers


def llguidance_python(loaded: list[tuple[Any, list[int]]], words: int) -> list[Work]:
    halves: list[Work] = []
    for part in split(loaded):
        natives = pyo3_matchers(part)
        row = np.zeros(words, dtype=np.int32)

        def work(rounds: int, natives: list[Any] = natives, row: np.ndarray = row) -> None:
            for _ in range(rounds):
                for native in natives:
                    native.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

        halves.append(work)
    return halves


def xgrammar_fill(loaded: list[tuple[Any, list[int]]], vocab: int) -> list[Work]:
    halves: list[Work] = []
    for part in split(loaded):
        matchers = python_matchers(part)
        row = bm.allocate(1, vocab, fill=0)

        def work(rounds: int, matchers: list[Any] = matchers, row: Any = row) -> None:
            for _ in range(rounds):
                for matcher in matchers:
                    matcher.fill_bitmask(row, 0)

        halves.append(work)
    return halves


def anchor_hash() -> list[Work]:
    data = b"x" * (1 << 22)

    def work(rounds: int) -> None:
        for _ in range(rounds):
            hashlib.sha256(data).digest()

    return [work, work]


def anchor_copy(words: int) -> list[Work]:
    halves: list[Work] = []
    for _ in range(2):
        src = np.ones(words, dtype=np.int32)
        dst = np.zeros_like(src)

        def work(rounds: int, src: np.ndarray = src, dst: np.ndarray = dst) -> None:
            for _ in range(rounds):
                np.copyto(dst, src)

        halves.append(work)
    return halves


def llguidance_native_walk(loaded: list[tuple[Any, list[int]]], vocab: int) -> list[Work]:
    """Per thread: one chain tree per schema (its instance's tokens), walked natively."""
    halves: list[Work] = []
    for part in split(loaded):
        jobs = []
        for compiled, body in part:
            matcher = compiled.matcher()
            tree = DraftTree.from_parents([0, *body], [-1, *range(len(body))])
            if traverse_walker(matcher, tree) is walk_llguidance:
                jobs.append((matcher, tree))
        out = bm.allocate(max(len(b) for _, b in loaded) + 1, vocab, fill=0)

        def work(rounds: int, jobs: list[Any] = jobs, out: Any = out) -> None:
            for _ in range(rounds):
                for matcher, tree in jobs:
                    fill_tree_bitmask(matcher, tree, out, None)

        halves.append(work)
    return halves


def traverse_walker(matcher: Any, tree: DraftTree) -> Any:
    """The walker that fills ``tree`` (llguidance's native walk takes chains, once ready)."""
    from espalier.constrained.backends.llguidance.tree_walk import native_takes, native_walk_ready

    compiled = matcher.compiled
    if compiled.native_slot is None or compiled.native_slot.wait(120) is None:
        return None
    return walk_llguidance if native_walk_ready(matcher) and native_takes(matcher, tree) else None


def executor_seconds(
    loaded: list[tuple[Any, list[int]]], words: int, threads: int, rounds: int, repeat: int
) -> tuple[float, int]:
    """Best seconds of ``rounds`` LLExecutor calls over every state, and the masks per call."""
    import llguidance

    natives = pyo3_matchers(loaded)
    rows = np.zeros((len(natives), words), dtype=np.int32)
    pairs = [(native, i) for i, native in enumerate(natives)]
    executor = llguidance.LLExecutor(threads)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(rounds):
            executor.unsafe_compute_mask_ptr(pairs, rows.ctypes.data, words * 4, len(natives))
        best = min(best, time.perf_counter() - start)
    return best, len(natives)


def gil_convoy(loaded: list[tuple[Any, list[int]]], words: int, calls: int) -> dict[str, Any]:
    """Per ``LLMatcher`` call: µs alone, and with a pure-Python thread spinning alongside."""
    native = pyo3_matchers(loaded[:1])[-1]
    token = loaded[0][1][-1]
    row = np.zeros(words, dtype=np.int32)
    ops: dict[str, Callable[[], Any]] = {
        "deep_copy": native.deep_copy,
        "try_consume_tokens": lambda: native.deep_copy().try_consume_tokens([token]),
        "is_accepting": native.is_accepting,
        "compute_ff_tokens": native.compute_ff_tokens,
        "unsafe_compute_mask_ptr": lambda: native.unsafe_compute_mask_ptr(
            row.ctypes.data, row.nbytes
        ),
    }
    out: dict[str, Any] = {}
    for name, op in ops.items():
        start = time.perf_counter()
        for _ in range(calls):
            op()
        alone = (time.perf_counter() - start) / calls
        stop = threading.Event()

        def spin(stop: threading.Event = stop) -> None:
            count = 0
            while not stop.is_set():
                count += 1

        spinner = threading.Thread(target=spin)
        spinner.start()
        time.sleep(0.01)
        start = time.perf_counter()
        for _ in range(calls):
            op()
        busy = (time.perf_counter() - start) / calls
        stop.set()
        spinner.join()
        out[name] = {"alone_us": round(1e6 * alone, 2), "spinner_us": round(1e6 * busy, 2)}
    return out


def record(name: str, one: float, two: float, masks: int) -> dict[str, Any]:
    return {
        "part": "mask_threads",
        "kind": name,
        "one_thread_us_per_mask": round(1e6 * one / masks, 3) if masks else None,
        "two_thread_speedup": round(one / two, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=".data/jsonschemabench")
    parser.add_argument("--schemas", type=int, default=8)
    parser.add_argument("--states", type=int, default=8, help="instance prefixes per schema")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: Gemma)")
    args = parser.parse_args(argv)
    tokenizer = (
        TokenizerInfo.from_pretrained(args.tokenizer) if args.tokenizer else default_tokenizer()
    )
    words = (tokenizer.vocab_size + 31) // 32
    files = sample_files(Path(args.data), args.schemas)
    summary: dict[str, float] = {}
    for name, halves, rounds in (
        ("anchor_hash", anchor_hash(), 20),
        ("anchor_copy_cache", anchor_copy(1 << 16), 4000),
        ("anchor_copy_dram", anchor_copy(1 << 23), 20),
    ):
        one, two = speedup(halves, rounds, args.repeat)
        emit(record(name, one, two, 0))
        summary[name] = round(one / two, 3)
    llg = grammars("llguidance", files, tokenizer, args.states)
    if len(llg) < 2:
        raise SystemExit(f"fewer than 2 schemas compiled from {args.data}")
    masks = args.rounds * sum(len(body) for _, body in llg)
    for name, halves in (
        ("llguidance_c_api", llguidance_c_api(llg, words)),
        ("llguidance_python", llguidance_python(llg, words)),
    ):
        one, two = speedup(halves, args.rounds, args.repeat)
        emit(record(name, one, two, masks) | {"schemas": len(llg)})
        summary[name] = round(one / two, 3)
    halves = llguidance_native_walk(llg, tokenizer.vocab_size)
    trees = args.rounds * sum(len(part) for part in split(llg))
    one, two = speedup(halves, args.rounds, args.repeat)
    emit(
        {
            "part": "mask_threads",
            "kind": "llguidance_native_walk",
            "one_thread_us_per_tree": round(1e6 * one / trees, 3),
            "two_thread_speedup": round(one / two, 3),
            "nodes_per_tree": args.states + 1,
        }
    )
    summary["llguidance_native_walk"] = round(one / two, 3)
    one, _ = executor_seconds(llg, words, 1, args.rounds, args.repeat)
    two, _ = executor_seconds(llg, words, 2, args.rounds, args.repeat)
    emit(record("llguidance_executor", one, two, masks) | {"schemas": len(llg)})
    summary["llguidance_executor"] = round(one / two, 3)
    emit({"part": "mask_threads", "kind": "gil", "calls": gil_convoy(llg, words, 200)})
    xgr = grammars("xgrammar", files, tokenizer, args.states)
    one, two = speedup(xgrammar_fill(xgr, tokenizer.vocab_size), args.rounds, args.repeat)
    xgr_masks = args.rounds * sum(len(body) for _, body in xgr)
    emit(record("xgrammar", one, two, xgr_masks) | {"schemas": len(xgr)})
    summary["xgrammar"] = round(one / two, 3)
    emit({"part": "summary", "two_thread_speedup": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
