"""The closing policy's cost on the engine thread, replayed on the CPU, printing JSON lines.

Each valid test instance of a sample of JSONSchemaBench schemas (the Gemma tokenizer, llguidance,
each matcher wrapped by the duplicate-key tracker as the engine wraps it) is fed token by token
through ``BudgetCloser.instead`` and the matcher, as plain decoding appends them, with
``max_tokens`` just past the instance: every token is inside the closing window, so each one is
checked, and the closer's memo is stitched or searched again where a token leaves its path (the
case of a speculative step's bonus token). No model: the cost is the grammar work alone.

``--streams FILE`` replays recorded outputs instead (``bench/gpu.py --dump-streams`` lines:
schema, tokens, max_tokens; ``bench/inputs/h200_b32_streams.jsonl`` holds an H200 run's batch
of 32: the states the GPU timeline's closing sees).

One line per side (``closing_replay``): tokens, searches (``ClosingPaths.search_after`` calls),
decision ms per token and in searches (CPU time of the thread: on a shared machine far steadier
than wall time), of it in the fallback search (``fallback_ms_total``: where it runs, most of the
time; the pass kept is the one with the least time outside it), a digest of every decision and
memo, and one of the decisions before each
instance's first greedy search that returned None (``greedy_digest``: where the fallback of
``engine/closing/backtrack.py`` has not yet run). With ``--anchor DIR`` the same replay runs
first under that checkout's code (its ``.venv``, this script), then here; the last line has the
time ratios and whether the digests are equal (the decisions must be: a function of the
tokens; a change to the fallback alone keeps ``greedy_decisions_equal``).

    .venv/bin/python bench/closing.py [--schemas 8] [--instances 40] [--streams FILE]
        [--reps 3] [--anchor /work/main]

``--trees N`` replays them as a speculative step decides: each step a chain of the next N
tokens drafted from the last one (oracle drafts), the lookahead job for it
(``BudgetCloser.lookaheads``, run on this thread: ``lookahead_ms_total``), then ``instead`` for
the N tokens (taken from the lookahead) and the step's bonus token (decided inline);
``--branches`` adds a random side node at each chain node (mostly tokens the grammar rejects).

``--batch-threads N`` instead times a step's searches (one state per output of the streams
file) one by one against one native batch call on 1 and on N threads (``closing_batch``).
    .venv/bin/python bench/closing.py --batch-threads 2 [--streams FILE] [--reps 3]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import spec as spec_bench  # bench/spec.py (this folder is on sys.path)
from anchor import run_anchor  # bench/anchor.py


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _pool(tokenizer: Any, schemas: int, instances: int, streams: str) -> list[tuple[Any, Any, int]]:
    """``(compiled, tokens, max_tokens)`` to replay: the streams file's lines, else valid
    instances with max_tokens just past them."""
    if not streams:
        pool = spec_bench.instance_pool(tokenizer, schemas, 16)[:instances]
        return [(compiled, tokens, len(tokens) + 3) for compiled, tokens in pool]
    lines = [json.loads(line) for line in Path(streams).read_text().splitlines() if line]
    compiled = [spec_bench.compile_schema(line["schema"], tokenizer) for line in lines]
    return [(c, line["tokens"], line["max_tokens"]) for c, line in zip(compiled, lines) if c]


def replay(
    schemas: int,
    instances: int,
    streams: str,
    reps: int,
    lockstep: int = 0,
    trees: int = 0,
    branches: bool = False,
) -> dict[str, Any]:
    """The replay on this process's ``espalier`` (the best of ``reps`` timed passes after one
    untimed pass); ``lockstep``: as :func:`lockstep_pass` on that many native threads;
    ``trees``: as :func:`trees_pass` with chains of that many drafted tokens (``branches``:
    and a side node at each)."""
    from espalier.engine import closing
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    pool = _pool(tokenizer, schemas, instances, streams)
    stops = set(tokenizer.stop_token_ids)
    searched = [0, 0.0]
    # every search: ``search_after`` where this tree has it (native or Python), else ``search``
    name = "search_after" if hasattr(closing.ClosingPaths, "search_after") else "search"
    search = getattr(closing.ClosingPaths, name)
    failed = [False]  # the greedy search returned None in this instance (the fallback's turn)
    fallback_s = [0.0]  # CPU time in ``or_fallback`` (the bounded fallback search, where it runs)
    # where the tree has the fallback behind ``or_fallback``, the greedy answers pass through it
    with_fallback = hasattr(closing.ClosingPaths, "or_fallback")

    def timed_search(self: Any, *args: Any) -> Any:
        started = time.thread_time()
        found = None
        try:
            found = search(self, *args)
            return found
        finally:
            searched[0] += 1
            searched[1] += time.thread_time() - started
            if not with_fallback:  # the old trees: the greedy search's own None
                if isinstance(found, tuple):  # search_after: (accepted, path)
                    failed[0] = failed[0] or (found[0] and found[1] is None)
                else:
                    failed[0] = failed[0] or found is None

    setattr(closing.ClosingPaths, name, timed_search)
    in_python = [0]  # searches made in Python (no native search for the matcher, or a fallback)
    if hasattr(closing.ClosingPaths, "python_search_after"):
        python_search = closing.ClosingPaths.python_search_after

        def counted(self: Any, *args: Any) -> Any:
            in_python[0] += 1
            return python_search(self, *args)

        closing.ClosingPaths.python_search_after = counted  # type: ignore[method-assign]
    if with_fallback:
        or_fallback = closing.ClosingPaths.or_fallback

        def watched(
            self: Any, matcher: Any, token: Any, limit: int, answer: Any, fallback: bool = True
        ) -> Any:
            failed[0] = failed[0] or (answer[0] and answer[1] is None)
            started = time.thread_time()
            try:
                return or_fallback(self, matcher, token, limit, answer, fallback)
            finally:
                fallback_s[0] += time.thread_time() - started

        closing.ClosingPaths.or_fallback = watched  # type: ignore[method-assign]
    # a grammar's start path is searched once and kept: whether the greedy search failed then
    start_failed: dict[int, bool] = {}
    start_path = closing.ClosingPaths.start_path

    def tracked_start_path(self: Any, compiled: Any, matcher: Any) -> Any:
        before, failed[0] = failed[0], False
        try:
            return start_path(self, compiled, matcher)
        finally:
            start_failed[id(compiled)] = start_failed.get(id(compiled), False) or failed[0]
            failed[0] = before or failed[0]

    closing.ClosingPaths.start_path = tracked_start_path  # type: ignore[method-assign]
    closer = closing.BudgetCloser(tokenizer, threads=max(lockstep, 1))
    for compiled, _, _ in pool[:1]:  # the C-API tokenizer (native walk and search) built first
        slot = getattr(compiled, "native_slot", None)
        if slot is not None:
            slot.wait()

    def one_pass() -> tuple[float, int, str, str]:
        digest, greedy = hashlib.sha256(), hashlib.sha256()
        seconds = 0.0
        tokens_seen = 0
        for k, (compiled, tokens, max_tokens) in enumerate(pool):
            request = _request(k, compiled, max_tokens, tokenizer)
            failed[0] = start_failed.get(id(compiled), False)
            for token in tokens:
                started = time.thread_time()
                path = closer.instead(request, token, stops, 1 << 20)
                seconds += time.thread_time() - started
                tokens_seen += 1
                decision = repr((path, closer._memo.get(request.request_id))).encode()
                digest.update(decision)
                if not failed[0]:  # the decisions before the first greedy None in the instance
                    greedy.update(decision)
                if path is not None:
                    break
                request.output_ids.append(token)
                assert request.matcher.accept(token)
            closer.forget(request.request_id)
        return seconds, tokens_seen, digest.hexdigest()[:16], greedy.hexdigest()[:16]

    ahead_s = [0.0]  # --trees: CPU time in the lookahead jobs
    run_pass = one_pass
    if lockstep:
        run_pass = functools.partial(lockstep_pass, closer, pool, tokenizer)
    elif trees:
        run_pass = functools.partial(trees_pass, closer, pool, tokenizer, trees, ahead_s, branches)
    run_pass()  # first-use work (lexers, start paths) out of the timing
    best: tuple[float, int, int, float, str, str] | None = None
    for _ in range(reps):
        searched[0], searched[1], in_python[0], fallback_s[0], ahead_s[0] = 0, 0.0, 0, 0.0, 0.0
        seconds, count, digest, greedy_digest = run_pass()
        if best is None or seconds - fallback_s[0] < best[0] - best[-2]:
            best = (seconds, count, searched[0], searched[1], digest, greedy_digest, in_python[0])
            best += (fallback_s[0], ahead_s[0])
    assert best is not None
    seconds, count, searches, search_s, digest, greedy_digest, python_searches, fallback = best[:8]
    return {
        "lookahead_ms_total": round(1e3 * best[8], 2),
        "instances": len(pool),
        "tokens": count,
        "searches": searches,
        # None: a tree whose searches are all Python (no ``python_search_after`` to count)
        "python_searches": python_searches
        if hasattr(closing.ClosingPaths, "python_search_after")
        else None,
        "decide_ms_per_token": round(1e3 * seconds / max(count, 1), 4),
        "search_ms_each": round(1e3 * search_s / max(searches, 1), 4),
        "search_ms_total": round(1e3 * search_s, 2),
        "decide_ms_total": round(1e3 * seconds, 2),
        "fallback_ms_total": round(1e3 * fallback, 2),
        "digest": digest,
        "greedy_digest": greedy_digest,
    }


def trees_pass(
    closer: Any, pool: Any, tokenizer: Any, drafted: int, ahead_s: list[float], branches: bool
) -> tuple[float, int, str, str]:
    """The pool's outputs decided as a speculative step decides them, request by request: per
    step the lookahead job for a chain of the next ``drafted`` tokens from the last one
    (``BudgetCloser.lookaheads``: its CPU time, searches included, also in ``ahead_s``), then
    ``instead`` for the chain's tokens and the bonus token after them. The digest covers each
    decision and memo, as :func:`replay`'s (equal to it: the lookahead decides as inline).

    ``branches``: each chain node also gets a sibling, a token of the same output drawn at
    random (seeded; the grammar rejects most there: a drafter's wrong guesses); where the job
    takes the step masks' ``filled`` flags, it is given them (computed here, untimed: a node
    is filled when the grammar accepts its path)."""

    stops = set(tokenizer.stop_token_ids)
    digest = hashlib.sha256()
    seconds = 0.0
    tokens_seen = 0
    for k, (compiled, tokens, max_tokens) in enumerate(pool):
        request = _request(k, compiled, max_tokens, tokenizer)
        position, closed = 0, False
        rng = random.Random(k)
        while position < len(tokens) and not closed:
            root = request.output_ids[-1] if request.output_ids else request.prompt_ids[-1]
            chain = tokens[position : position + drafted]
            tree, parents = [root, *chain], list(range(-1, len(chain)))
            if branches:
                for node in range(len(chain)):
                    tree.append(rng.choice(tokens))
                    parents.append(node)
            filled = _filled(request.matcher, tree, parents) if branches else None
            started = time.thread_time()
            job = closer.lookaheads([(request, tree, parents)], 1 << 20)
            if job is not None:
                if filled is not None and "filled" in inspect.signature(job).parameters:
                    job(filled)
                else:
                    job()
            ahead_s[0] += time.thread_time() - started
            seconds += time.thread_time() - started
            for token in tokens[position : position + drafted + 1]:  # the chain, the bonus
                started = time.thread_time()
                path = closer.instead(request, token, stops, 1 << 20)
                seconds += time.thread_time() - started
                tokens_seen += 1
                digest.update(repr((path, closer._memo.get(request.request_id))).encode())
                if path is not None:
                    closed = True
                    break
                request.output_ids.append(token)
                assert request.matcher.accept(token)
            position += drafted + 1
        closer.forget(request.request_id)
    return seconds, tokens_seen, digest.hexdigest()[:16], digest.hexdigest()[:16]


def _request(k: int, compiled: Any, max_tokens: int, tokenizer: Any) -> Any:
    """Request ``r{k}`` with a fresh matcher of ``compiled``, wrapped as the engine wraps it."""
    from espalier.constrained.keys import with_unique_keys
    from espalier.engine.api import SamplingParams
    from espalier.engine.request import Request

    request = Request(f"r{k}", [1], SamplingParams(max_tokens=max_tokens), 0)
    request.compiled = compiled
    request.matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
    return request


def _filled(matcher: Any, tree: list[int], parents: list[int]) -> Any:
    """bool ``[n]``: the grammar accepts the path root -> node (the root: always)."""
    import numpy as np

    filled = np.ones(len(tree), dtype=bool)
    for node in range(1, len(tree)):
        path = []
        at = node
        while at > 0:
            path.append(tree[at])
            at = parents[at]
        filled[node] = matcher.accepted_prefix(path[::-1]) == len(path)
    return filled


def lockstep_pass(closer: Any, pool: Any, tokenizer: Any) -> tuple[float, int, str, str]:
    """The pool's outputs decided as plain decoding's engine step decides them: all requests
    one token per step, ``BudgetCloser.prepare`` for the step (its searches, and where the tree
    has them there, its stitch checks, in one native call per wave), then ``instead`` for each
    token; the engine thread's CPU time of both. The digest covers each request's decisions
    (``greedy_digest``: not tracked here, empty)."""

    stops = set(tokenizer.stop_token_ids)
    live = []
    for k, (compiled, tokens, max_tokens) in enumerate(pool):
        request = _request(k, compiled, max_tokens, tokenizer)
        live.append((request, tokens, hashlib.sha256()))
    digests = [digest for _, _, digest in live]
    seconds = 0.0
    seen = 0
    while live:
        items = [(r, tokens[len(r.output_ids)], len(r.output_ids), stops) for r, tokens, _ in live]
        started = time.thread_time()
        closer.prepare(items, 1 << 20)
        paths = [closer.instead(r, token, stops, 1 << 20) for r, token, _, _ in items]
        seconds += time.thread_time() - started
        going = []
        for (request, tokens, digest), path, item in zip(live, paths, items):
            seen += 1
            digest.update(repr((path, closer._memo.get(request.request_id))).encode())
            if path is not None:
                closer.forget(request.request_id)
                continue
            request.output_ids.append(item[1])
            assert request.matcher.accept(item[1])
            if len(request.output_ids) < len(tokens):
                going.append((request, tokens, digest))
            else:
                closer.forget(request.request_id)
        live = going
    combined = hashlib.sha256(b"".join(d.digest() for d in digests)).hexdigest()[:16]
    return seconds, seen, combined, ""


def batch_scaling(streams: str, threads: int, reps: int) -> dict[str, Any]:
    """A step's searches in one call: one state per replayed output (its matcher part way along
    it, the next token, the search limit), searched one by one (``search_after``) and as one
    native batch on 1 and on ``threads`` threads; wall time, best of ``reps``."""
    from espalier.constrained.keys import with_unique_keys
    from espalier.engine import closing
    from espalier.engine.closing.batch import as_answer as as_pair
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    pool = _pool(tokenizer, 8, 32, streams)
    paths = closing.ClosingPaths(tokenizer)
    pool[0][0].native_slot.wait()
    states = []
    for k, (compiled, tokens, _) in enumerate(pool):
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
        cut = (7 * k + 3) % max(len(tokens) - 1, 1)
        assert matcher.accept_tokens(tokens[:cut]) == cut
        states.append((matcher, tokens[cut]))

    def one_by_one() -> Any:
        return [paths.search_after(m, t, closing.SEARCH_LIMIT) for m, t in states]

    def in_python() -> Any:  # the anchor: the definition, on forks
        return [paths.python_search_after(m, t, closing.SEARCH_LIMIT) for m, t in states]

    def batched(count: int) -> Any:
        searches = [m.native_closing(t, closing.SEARCH_LIMIT) for m, t in states]
        return searches[0].kind(paths.rules, searches, count)

    timings: dict[str, float] = {}
    runs = (("python", in_python), ("one_by_one", one_by_one), ("batch_1", lambda: batched(1)))
    for name, run in runs:
        timings[name] = _best_wall(run, reps)
    timings[f"batch_{threads}"] = _best_wall(lambda: batched(threads), reps)
    assert in_python() == [as_pair(o) for o in batched(threads)]  # the same paths
    return {"searches": len(states)} | {f"{k}_ms": round(1e3 * v, 2) for k, v in timings.items()}


def _best_wall(run: Any, reps: int) -> float:
    run()  # first-use work (bases, lexers) out of the timing
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=8)
    parser.add_argument("--instances", type=int, default=40)
    parser.add_argument("--streams", default="", help="recorded outputs to replay (JSON lines)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--anchor", help="a checkout (with its .venv) to replay first")
    parser.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--lockstep",
        type=int,
        default=0,
        help="decide as the engine step does (prepare, then instead) on N native threads",
    )
    parser.add_argument(
        "--trees",
        type=int,
        default=0,
        help="decide as a speculative step does: a lookahead over chains of N drafted tokens",
    )
    parser.add_argument(
        "--branches",
        action="store_true",
        help="with --trees: a random side node at each chain node",
    )
    parser.add_argument(
        "--batch-threads",
        type=int,
        default=0,
        help="time a step's searches as one batch (N threads)",
    )
    args = parser.parse_args()
    if args.batch_threads:
        streams = args.streams or "bench/inputs/h200_b32_streams.jsonl"
        emit({"part": "closing_batch"} | batch_scaling(streams, args.batch_threads, args.reps))
        return
    sizes = ["--schemas", str(args.schemas), "--instances", str(args.instances)]
    sizes += ["--reps", str(args.reps), "--lockstep", str(args.lockstep)]
    sizes += ["--trees", str(args.trees)] + (["--branches"] if args.branches else [])
    if args.streams:  # the anchor runs in its own folder
        sizes += ["--streams", str(Path(args.streams).resolve())]
    anchor = None
    if args.anchor:
        root = Path(args.anchor).resolve()
        anchor = run_anchor(root, __file__, sizes)
        emit({"part": "closing_replay", "side": "anchor", "tree": str(root)} | anchor)
    ours = replay(
        args.schemas,
        args.instances,
        args.streams,
        args.reps,
        args.lockstep,
        args.trees,
        args.branches,
    )
    if args.json_only:
        print(json.dumps(ours))
        return
    emit({"part": "closing_replay", "side": "this tree"} | ours)
    if anchor is not None:
        emit(
            {
                "part": "closing_replay_ratio",
                "decisions_equal": anchor["digest"] == ours["digest"],
                "greedy_decisions_equal": anchor["greedy_digest"] == ours["greedy_digest"],
                "decide_this_over_anchor": round(
                    ours["decide_ms_total"] / max(anchor["decide_ms_total"], 1e-9), 3
                ),
                "decide_less_fallback_this_over_anchor": round(
                    (ours["decide_ms_total"] - ours["fallback_ms_total"])
                    / max(anchor["decide_ms_total"] - anchor["fallback_ms_total"], 1e-9),
                    3,
                ),
                "lookahead_this_over_anchor": round(
                    ours["lookahead_ms_total"] / max(anchor["lookahead_ms_total"], 1e-9), 3
                ),
                "search_this_over_anchor": round(
                    ours["search_ms_total"] / max(anchor["search_ms_total"], 1e-9), 3
                ),
            }
        )


if __name__ == "__main__":
    sys.exit(main())
