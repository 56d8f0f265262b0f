"""The measurements behind ``espalier bench-tree`` (see ``server/cli_bench_tree.py``)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.traverse import fill_tree_bitmask
from espalier.constrained.traverse_batch import TreeMaskBatch
from espalier.constrained.traverse_oracle import compare, replay_tree
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree_random import grow_tree


@dataclass
class Case:
    name: str
    instance: list[int]  # tokens of a valid instance + a stop token
    compiled: dict[str, Any]  # backend -> CompiledGrammar


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
    folder: Path, backends: list[str], tokenizer: Any, max_schemas: int, timeout: float, rng: Any
) -> list[Case]:
    from espalier.constrained.backends import get_backend
    from espalier.constrained.spec import GrammarSpec
    from espalier.server.cli_bench_tree import compile_with_timeout

    files = sorted(p for p in folder.rglob("*.json") if p.stat().st_size < 32_000)
    rng.shuffle(files)
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
            backend = get_backend(name, tokenizer)
            result = compile_with_timeout(partial(backend.compile, spec), timeout)
            if result is not None:
                compiled[name] = result
        if "xgrammar" in compiled or set(compiled) == set(backends):
            instance = tokenizer.encode(json.dumps(data)) + [stop]
            cases.append(Case(f"{path.parent.name}/{path.name}", instance, compiled))
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


def timed(repeat: int, fn: Callable[..., Any], *args: Any) -> float:
    """Best of ``repeat`` wall times of ``fn(*args)`` (the machine is shared: min filters noise)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def fill_fresh_tree(matcher: Any, arrays: tuple[np.ndarray, ...], out: torch.Tensor) -> None:
    """What serving does per step: wrap the drafter's arrays, then fill (no budget)."""
    fill_tree_bitmask(matcher, DraftTree(*arrays), out, None)


def stats(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {}
    ms = np.asarray(seconds) * 1e3
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 4),
        "p99_ms": round(float(np.percentile(ms, 99)), 4),
        "max_ms": round(float(ms.max()), 4),
        "n": len(seconds),
    }


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
    bounded: dict[str, list[float]] = {}
    hits: dict[str, int] = {}
    slowest: dict[str, tuple[float, str, int]] = {}
    mismatches = 0
    for k, item in enumerate(trees):
        tree = item.tree
        arrays = (tree.tokens, tree.first_child, tree.next_sibling)
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
            fill_tree_bitmask(matcher, DraftTree(*arrays), out, budget=None)  # warm-up
            seconds = timed(repeat, fill_fresh_tree, matcher, arrays, out)
            times.setdefault(name, []).append(seconds)
            if seconds > slowest.get(name, (0.0, "", 0))[0]:
                slowest[name] = (seconds, item.case.name, len(item.prefix))
            for _ in range(repeat):
                masks = fill_tree_bitmask(matcher, DraftTree(*arrays), out, budget=budget)
                bounded.setdefault(name, []).append(masks.seconds)
                hits[name] = hits.get(name, 0) + int(masks.budget_hit)
            if k < oracle_trees:
                masks = fill_tree_bitmask(matcher, DraftTree(*arrays), out, budget=None)
                oracle = replay_tree(compiled.matcher, item.prefix, tree)
                mismatches += len(compare(masks, out, tree, oracle))
    record: dict[str, Any] = {"nodes": size, "trees": len(trees), "oracle_mismatches": mismatches}
    for name, seconds in times.items():
        record[name] = stats(seconds)
    for name, seconds in bounded.items():
        within = float(np.mean(np.asarray(seconds) <= budget))
        record[f"{name}_budget"] = {
            **stats(seconds),
            "hit_share": round(hits[name] / len(seconds), 4),
            "within_budget_share": round(within, 4),
        }
    for name, (seconds, where, cut) in slowest.items():
        record[f"{name}_slowest"] = {"ms": round(seconds * 1e3, 3), "schema": where, "at": cut}
    emit(record)
    return record


def run_batches(
    trees: list[TreeCase], name: str, vocab: int, max_threads: int, emit: Callable[..., None]
) -> dict[str, float]:
    items = []
    for item in trees:
        compiled = item.case.compiled.get(name)
        matcher = matcher_at(compiled, item.prefix) if compiled is not None else None
        if matcher is not None:
            items.append((matcher, item.tree))
    if not items:
        return {}
    batch = TreeMaskBatch(items, vocab)
    result: dict[str, float] = {}
    for threads in range(1, max_threads + 1):
        with ThreadPoolExecutor(threads) as pool:
            batch.submit(pool, budget=None).result()  # warm-up
            walls = []
            for _ in range(5):
                start = time.perf_counter()
                batch.submit(pool, budget=None).result()
                walls.append(time.perf_counter() - start)
        result[str(threads)] = round(float(np.median(walls)) * 1e3, 3)
    speedup = {t: round(result["1"] / ms, 3) for t, ms in result.items()}
    emit({"batch": name, "trees": len(items), "wall_ms": result, "speedup": speedup})
    return result


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
    from espalier.constrained.tokenizer import TokenizerInfo

    tokenizer = TokenizerInfo.default()
    rng = np.random.default_rng(seed)
    cases = load_cases(
        folder, backends, tokenizer, max_schemas, compile_timeout, random.Random(seed)
    )
    emit(
        {
            "schemas": len(cases),
            "per_backend": {b: sum(b in c.compiled for c in cases) for b in backends},
        }
    )
    summary: dict[str, Any] = {}
    for size in sizes:
        trees = make_trees(cases, size, trees_per_size, rng)
        record = run_size(trees, backends, tokenizer.vocab_size, repeat, oracle_trees, budget, emit)
        main = "xgrammar" if "xgrammar" in record else backends[0]
        summary[str(size)] = {
            "seed_p50_ms": record["seed"].get("p50_ms"),
            "xgrammar_native_p50_ms": record["xgrammar_native"].get("p50_ms"),
            "espalier_p50_ms": record.get(main, {}).get("p50_ms"),
            "espalier_p99_ms": record.get(main, {}).get("p99_ms"),
            "oracle_mismatches": record["oracle_mismatches"],
            **{f"espalier_{b}_p50_ms": record.get(b, {}).get("p50_ms") for b in backends},
            **{f"espalier_{b}_p99_ms": record.get(b, {}).get("p99_ms") for b in backends},
            **{
                f"espalier_{b}_budget_p99_ms": record.get(f"{b}_budget", {}).get("p99_ms")
                for b in backends
            },
        }
    big = max(sizes)
    trees = make_trees(cases, big, batch, rng)
    for name in backends:
        scaling = run_batches(trees, name, tokenizer.vocab_size, max_threads, emit)
        if scaling:
            summary.setdefault("batch_ms", {})[name] = scaling
    return summary
