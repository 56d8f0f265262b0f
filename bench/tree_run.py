"""The measurements behind ``bench/tree.py`` (which says what is measured)."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import repo_root  # noqa: F401  (bench/repo_root.py: tests.fixtures importable)
import torch
from compile_probe import CompileProbe  # bench/compile_probe.py (this folder is on sys.path)
from tree_measure import (  # bench/tree_measure.py
    Tally,
    add_run,
    arrays_of,
    measure_backend,
    size_summary,
    stats,
    tally_record,
    timed,
)

from espalier.constrained import bitmask as bm
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.masks import TreeMasks, fill_tree_bitmask
from tests.fixtures.tree_oracle import compare, replay_tree
from tests.fixtures.tree_random import grow_tree


@dataclass
class Case:
    name: str
    instance: list[int]  # tokens of a valid instance + a stop token
    compiled: dict[str, Any]  # backend -> CompiledGrammar
    auto: str | None = None  # the backend ``backend="auto"`` picks (strict mode), if compiled


def auto_choice(schema: Any, compiled: dict[str, Any]) -> str | None:
    """What a user gets by default: the first backend of ``AUTO_ORDER`` that enforces every
    keyword (``constrained/compile.py``), among those compiled here; None if strict mode
    refuses the schema."""
    from espalier.constrained.compile import AUTO_ORDER, prepare_schema
    from espalier.constrained.errors import GrammarError

    try:
        exact = prepare_schema(schema).enforcing(AUTO_ORDER)
    except GrammarError:
        return None
    return next((name for name in exact if name in compiled), None)


@dataclass
class TreeCase:
    case: Case
    prefix: list[int]
    tree: DraftTree


def seed_traverse(matcher: Any, tree_t: tuple[torch.Tensor, ...], bitmask: torch.Tensor) -> None:
    """The seed's algorithm: recursive DFS, reading torch tensors one element at a time."""
    first_child, next_sibling, tokens = tree_t

    def dfs(node: int, parent: int) -> None:
        if node == 0:
            accepted = True
        else:
            token = tokens[node]
            word = bitmask[parent][token // 32]
            accepted = bool((word >> (token % 32)) & 1)
        if accepted:
            if node != 0:
                matcher.accept_token(int(tokens[node]))
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, node)
                child = int(first_child[node])
                if child != -1:
                    dfs(child, node)
            if node != 0:
                matcher.rollback(1)
        sibling = int(next_sibling[node])
        if sibling != -1:
            dfs(sibling, parent)

    dfs(0, -1)


def load_cases(
    folder: Path,
    backends: list[str],
    tokenizer: Any,
    max_schemas: int,
    probe: CompileProbe,
    timeout: float,
    rng: Any,
) -> list[Case]:
    """Up to ``max_schemas`` schemas of ``folder`` (random order) with a valid instance, compiled
    by every backend (or at least by xgrammar, which grows the trees).

    Each compile runs first in ``probe``'s child, killed past ``timeout``; only what finished in
    time is compiled here, so no compile is left running during the measurements.
    """
    from espalier.constrained.backends import get_backend
    from espalier.constrained.spec import GrammarSpec

    files = sorted(p for p in folder.rglob("*.json") if p.stat().st_size < 32_000)
    rng.shuffle(files)
    if "llguidance" in backends:  # its native walk's tokenizer: ready before the first compile
        get_backend("llguidance", tokenizer).tree_walk()  # type: ignore[attr-defined]
    cases: list[Case] = []
    stop = tokenizer.stop_token_ids[0]
    for path in files:
        if len(cases) >= max_schemas:
            break
        try:
            item = json.loads(path.read_text())
            data = next(t["data"] for t in item["tests"] if t.get("valid"))
            spec = GrammarSpec.json_schema(item["schema"])
        except Exception:
            continue
        compiled = {}
        for name in backends:
            if not probe.compile(name, spec, timeout).ok:
                continue
            try:
                compiled[name] = get_backend(name, tokenizer).compile(spec)
            except Exception:  # refused here although the child compiled it: skipped too
                continue
        if "xgrammar" in compiled or set(compiled) == set(backends):
            instance = tokenizer.encode(json.dumps(data)) + [stop]
            name = f"{path.parent.name}/{path.name}"
            cases.append(Case(name, instance, compiled, auto_choice(item["schema"], compiled)))
    return cases


def make_trees(
    cases: list[Case], size: int, count: int, rng: np.random.Generator
) -> list[TreeCase]:
    trees = []
    for k in range(count):
        case = cases[k % len(cases)]
        grower = case.compiled.get("xgrammar") or next(iter(case.compiled.values()))
        cut = int(rng.integers(0, len(case.instance)))
        prefix, body = case.instance[:cut], case.instance[cut:]
        tree = grow_tree(grower.matcher, prefix, body, size, rng)
        trees.append(TreeCase(case, prefix, tree))
    return trees


def matcher_at(compiled: Any, prefix: list[int]) -> Any:
    matcher = compiled.matcher()
    return matcher if all(matcher.accept(t) for t in prefix) else None


def run_size(
    trees: list[TreeCase],
    backends: list[str],
    vocab: int,
    repeat: int,
    oracle_trees: int,
    budget: float,
    emit: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    size = max(t.tree.num_nodes for t in trees)
    out = bm.allocate(size, vocab)
    times: dict[str, list[float]] = {"seed": [], "xgrammar_native": []}
    tallies = {name: Tally([], []) for name in [*backends, "auto"]}
    mismatches = 0
    for k, item in enumerate(trees):
        tree = item.tree
        xgr = item.case.compiled.get("xgrammar")
        matcher = matcher_at(xgr, item.prefix) if xgr is not None else None
        if matcher is not None:
            native = matcher.native
            tree_t = tuple(torch.from_numpy(a) for a in (tree.first_child, tree.next_sibling))
            tree_t += (torch.from_numpy(tree.tokens),)
            rows = out[: tree.num_nodes]
            seed_traverse(native, tree_t, rows)
            times["seed"].append(timed(repeat, seed_traverse, native, tree_t, rows))
            args = (tree_t[0], tree_t[1], tree_t[2], rows)
            times["xgrammar_native"].append(timed(repeat, native.traverse_draft_tree, *args))
        for name in backends:
            compiled = item.case.compiled.get(name)
            matcher = matcher_at(compiled, item.prefix) if compiled is not None else None
            if matcher is None:
                continue
            run = measure_backend(item, matcher, out, repeat, budget)
            add_run(tallies[name], run)
            if name == item.case.auto:
                add_run(tallies["auto"], run)
            if k < oracle_trees:
                assert compiled is not None  # a matcher came from it
                for bound in (None, budget):
                    masks = fill_tree_bitmask(matcher, DraftTree(*arrays_of(tree)), out, bound)
                    masks.wait_late_writes()
                    oracle = replay_tree(compiled.matcher, item.prefix, tree)
                    mismatches += len(compare(masks, out, tree, oracle))
    record: dict[str, Any] = {"nodes": size, "trees": len(trees), "oracle_mismatches": mismatches}
    for name, seconds in times.items():
        record[name] = stats(seconds)
    for name, tally in tallies.items():
        if tally.seconds:
            parts = tally_record(tally, budget)
            record[name] = parts["unbounded"]
            record[f"{name}_budget"] = parts["budget"]
            record[f"{name}_slowest"] = parts["slowest"]
            record[f"{name}_budget_slowest"] = parts["budget_slowest"]
    record["auto_picks"] = dict(Counter(str(t.case.auto) for t in trees))
    emit(record)
    return record


def run_batches(
    trees: list[TreeCase],
    name: str,
    vocab: int,
    max_threads: int,
    budget: float,
    emit: Callable[..., None],
) -> dict[str, Any]:
    """Wall time of one batch on 1..N threads, without a budget and with ``budget`` per tree.

    Without one the batch lasts at least as long as its slowest tree (``slowest_tree_ms``),
    whatever the thread count; with one every tree is bounded and threads can share the work.
    """
    items = []
    for item in trees:
        compiled = item.case.compiled.get(name)
        matcher = matcher_at(compiled, item.prefix) if compiled is not None else None
        if matcher is not None:
            items.append((matcher, item.tree))
    if not items:
        return {}
    offsets = np.cumsum([0] + [tree.num_nodes for _, tree in items]).tolist()
    rows = bm.allocate(offsets[-1], vocab)

    def fill_all(pool: ThreadPoolExecutor, bound: float | None) -> list[TreeMasks]:
        """Every tree into its rows of one buffer, one task per tree on ``pool``."""
        tasks = [
            pool.submit(m.fill_tree, t, rows[offsets[b] : offsets[b + 1]], budget=bound)
            for b, (m, t) in enumerate(items)
        ]
        return [task.result() for task in tasks]

    result: dict[str, Any] = {}
    for label, bound in (("unbounded", None), ("budget", budget)):
        walls: dict[str, float] = {}
        slowest = 0.0
        for threads in range(1, max_threads + 1):
            with ThreadPoolExecutor(threads) as pool:
                all(m.wait_late_writes() for m in fill_all(pool, bound))
                runs = []
                for _ in range(5):
                    start = time.perf_counter()
                    masks = fill_all(pool, bound)
                    runs.append(time.perf_counter() - start)
                    all(m.wait_late_writes() for m in masks)  # the buffer is reused next run
                    slowest = max([slowest, *(m.seconds for m in masks)])
            walls[str(threads)] = round(float(np.median(runs)) * 1e3, 3)
        speedup = {t: round(walls["1"] / ms, 3) for t, ms in walls.items()}
        result[label] = {"wall_ms": walls, "speedup": speedup}
        result[label]["slowest_tree_ms"] = round(slowest * 1e3, 3)
    emit({"batch": name, "trees": len(items), "budget_ms": budget * 1e3, **result})
    return result


def llguidance_walk(backends: list[str], tokenizer: Any) -> str | None:
    """Which llguidance tree walk runs: "native" (C, ``constrained/backends/llguidance/native/``)
    or why not."""
    if "llguidance" not in backends:
        return None
    from espalier.constrained.backends import get_backend

    walk: str = get_backend("llguidance", tokenizer).tree_walk()  # type: ignore[attr-defined]
    return walk


def run_benchmark(
    folder: Path,
    *,
    sizes: list[int],
    backends: list[str],
    batch: int,
    max_schemas: int,
    trees_per_size: int,
    repeat: int,
    oracle_trees: int,
    budget: float,
    max_threads: int,
    compile_timeout: float,
    seed: int,
    emit: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    from espalier.server.default_model import default_tokenizer
    from espalier.server.gc_freeze import freeze_startup_heap

    tokenizer = default_tokenizer()
    rng = np.random.default_rng(seed)
    with CompileProbe(backends) as probe:
        start = time.perf_counter()
        order = random.Random(seed)
        cases = load_cases(folder, backends, tokenizer, max_schemas, probe, compile_timeout, order)
        kills, load_s = probe.kills, time.perf_counter() - start
    emit(
        {
            "schemas": len(cases),
            "per_backend": {b: sum(b in c.compiled for c in cases) for b in backends},
            "gc_frozen_objects": freeze_startup_heap(),  # as the server does after loading
            "compiles_killed_at_timeout": kills,  # in the probe's child: none runs on here
            "load_s": round(load_s, 1),
            "llguidance_walk": llguidance_walk(backends, tokenizer),
        }
    )
    summary: dict[str, Any] = {}
    for size in sizes:
        trees = make_trees(cases, size, trees_per_size, rng)
        record = run_size(trees, backends, tokenizer.vocab_size, repeat, oracle_trees, budget, emit)
        summary[str(size)] = size_summary(record, backends)
    big = max(sizes)
    trees = make_trees(cases, big, batch, rng)
    for name in backends:
        scaling = run_batches(trees, name, tokenizer.vocab_size, max_threads, budget, emit)
        if scaling:
            summary.setdefault("batch_ms", {})[name] = scaling
    return summary
