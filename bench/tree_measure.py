"""Per-tree measurements and summaries behind ``bench/tree.py`` (``tree_run.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.masks import fill_tree_bitmask

if TYPE_CHECKING:
    from tree_run import TreeCase


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


@dataclass
class Tally:
    """One backend's measurements at one tree size (the ``auto`` line borrows the picked one's).

    ``budget_slowest``: (ms, schema, prefix length, abandoned, root fill ms) of the slowest
    budgeted fill: what made it slow is either a root row the budget may not cut (``root_ms``
    close to ``ms``) or a walk past the deadline.
    """

    seconds: list[float]
    bounded: list[float]
    hits: int = 0
    abandoned: int = 0
    slowest: tuple[float, str, int] = (0.0, "", 0)
    budget_slowest: tuple[float, str, int, bool, float] = (0.0, "", 0, False, 0.0)


def root_fill_ms(matcher: Any, out: torch.Tensor) -> float:
    """One fill of the root row alone (what no budget can cut)."""
    start = time.perf_counter()
    matcher.fill_bitmask(out, 0)
    return (time.perf_counter() - start) * 1e3


def measure_backend(
    item: TreeCase, matcher: Any, out: torch.Tensor, repeat: int, budget: float
) -> Tally:
    """Unbounded (best of ``repeat``) and bounded (each of ``repeat``) fills of one tree."""
    tree = item.tree
    arrays = arrays_of(tree)
    fill_tree_bitmask(matcher, DraftTree(*arrays), out, budget=None)  # warm-up
    seconds = timed(repeat, fill_fresh_tree, matcher, arrays, out)
    run = Tally([seconds], [], slowest=(seconds, item.case.name, len(item.prefix)))
    for _ in range(repeat):
        masks = fill_tree_bitmask(matcher, DraftTree(*arrays), out, budget=budget)
        masks.wait_late_writes()  # an abandoned fill may still write ``out``: not reused before
        run.bounded.append(masks.seconds)
        run.hits += int(masks.budget_hit)
        run.abandoned += int(masks.abandoned)
        if masks.seconds > run.budget_slowest[0]:
            root_ms = root_fill_ms(matcher, out)
            where = (item.case.name, len(item.prefix))
            run.budget_slowest = (masks.seconds, *where, masks.abandoned, root_ms)
    return run


def add_run(tally: Tally, run: Tally) -> None:
    tally.seconds += run.seconds
    tally.bounded += run.bounded
    tally.hits += run.hits
    tally.abandoned += run.abandoned
    tally.slowest = max(tally.slowest, run.slowest)
    tally.budget_slowest = max(tally.budget_slowest, run.budget_slowest)


def tally_record(tally: Tally, budget: float) -> dict[str, Any]:
    bounded = np.asarray(tally.bounded)
    ms, schema, cut, abandoned, root_ms = tally.budget_slowest
    return {
        "unbounded": stats(tally.seconds),
        "budget": {
            **stats(tally.bounded),
            "hit_share": round(tally.hits / max(len(bounded), 1), 4),
            "abandoned_share": round(tally.abandoned / max(len(bounded), 1), 4),
            "within_budget_share": round(float(np.mean(bounded <= budget)), 4),
            "within_budget_plus_1ms_share": round(float(np.mean(bounded <= budget + 1e-3)), 4),
        },
        "slowest": {"ms": round(tally.slowest[0] * 1e3, 3), "schema": tally.slowest[1]}
        | {"at": tally.slowest[2]},
        "budget_slowest": {"ms": round(ms * 1e3, 3), "schema": schema, "at": cut}
        | {"abandoned": abandoned, "root_fill_ms": round(root_ms, 3)},
    }


def arrays_of(tree: DraftTree) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tree.tokens, tree.first_child, tree.next_sibling


def size_summary(record: dict[str, Any], backends: list[str]) -> dict[str, Any]:
    """The last line's entry for one size. ``espalier_p50_ms``/``_p99_ms`` stay xgrammar's (the
    like-for-like comparison with the seed and the native call, ``espalier_backend`` says so);
    ``espalier_auto_*`` is what a user gets by default (the backend ``auto`` picks per schema)."""
    main = "xgrammar" if "xgrammar" in record else backends[0]
    seed = record["seed"].get("p50_ms")

    def get(name: str, key: str) -> Any:
        return record.get(name, {}).get(key)

    out: dict[str, Any] = {
        "seed_p50_ms": seed,
        "xgrammar_native_p50_ms": get("xgrammar_native", "p50_ms"),
        "espalier_backend": main,
        "espalier_p50_ms": get(main, "p50_ms"),
        "espalier_p99_ms": get(main, "p99_ms"),
        "oracle_mismatches": record["oracle_mismatches"],
    }
    for b in [*backends, "auto"]:
        p50 = get(b, "p50_ms")
        out[f"espalier_{b}_p50_ms"] = p50
        out[f"espalier_{b}_p99_ms"] = get(b, "p99_ms")
        out[f"espalier_{b}_seed_speedup_p50"] = round(seed / p50, 2) if seed and p50 else None
        out[f"espalier_{b}_budget_p99_ms"] = get(f"{b}_budget", "p99_ms")
        out[f"espalier_{b}_budget_max_ms"] = get(f"{b}_budget", "max_ms")
        out[f"espalier_{b}_within_budget_share"] = get(f"{b}_budget", "within_budget_share")
    native = get("xgrammar_native", "p50_ms")
    if native and get("xgrammar", "p50_ms"):
        out["espalier_xgrammar_vs_native_p50"] = round(get("xgrammar", "p50_ms") / native, 3)
    return out
