"""Tree masks of a verify batch, built on CPU threads while the target's forward runs.

``MaskBuilder.submit`` starts filling one bitmask row per node of every constrained request's
tree (into one pinned buffer) and returns at once; ``PendingMasks.result`` waits. The engine submits
before launching the verify forward and waits after it, so the CPU walk hides under the GPU work.

Row semantics (``constrained.tree``): row ``i`` holds the tokens allowed after the path root→i;
``valid[i]`` says the path is grammar-valid, ``filled[i]`` that the row was computed. The fill
itself is the grammar layer's tree walk (``constrained.traverse``); here we only lay the trees of
the batch out and stack the results.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.engine.spec.tree_builder import Draft, sibling_links
from espalier.engine.spec.verify import TreeMasks

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarMatcher


@dataclass
class PendingMasks:
    """Masks being filled: one future per constrained request; ``result()`` blocks until done."""

    bitmask: torch.Tensor | None
    mask_rows: torch.Tensor
    parts: list[Future[tuple[np.ndarray, np.ndarray]] | int]  # a future, or n unconstrained nodes
    ready: TreeMasks | None = None

    def result(self) -> TreeMasks:
        if self.ready is None:
            valid: list[np.ndarray] = []
            filled: list[np.ndarray] = []
            for part in self.parts:
                if isinstance(part, int):
                    valid.append(np.ones(part, dtype=bool))
                    filled.append(valid[-1])
                else:
                    v, f = part.result()
                    valid.append(v)
                    filled.append(f)
            self.ready = TreeMasks(
                self.bitmask,
                self.mask_rows,
                torch.from_numpy(np.concatenate(valid)),
                torch.from_numpy(np.concatenate(filled)),
            )
        return self.ready


class MaskBuilder:
    """Fills the tree masks of a batch on a small thread pool, one task per constrained request
    (the grammar backends release the GIL while they walk)."""

    def __init__(
        self,
        vocab_size: int,
        *,
        threads: int = 2,
        pin_memory: bool = False,
        budget_s: float | None = None,
    ) -> None:
        """vocab_size: V of the bitmask rows; budget_s: time budget per tree (None = none)."""
        self.vocab_size = vocab_size
        self.budget_s = budget_s
        self.pin_memory = pin_memory
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="tree-mask")
        self._buffer: torch.Tensor | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _rows(self, n: int) -> torch.Tensor:
        """``n`` rows of one reused (pinned on CUDA) buffer: page-locking per step is slow. The
        previous step's upload finished at its host sync, so the rows are free to overwrite;
        the tree walk writes every row it hands to verification (``constrained.traverse``)."""
        if self._buffer is None or self._buffer.shape[0] < n:
            size = max(n, 2 * (0 if self._buffer is None else self._buffer.shape[0]))
            self._buffer = bm.allocate(size, self.vocab_size, pin_memory=self.pin_memory, fill=0)
        return self._buffer[:n]

    def submit(
        self, matchers: Sequence[GrammarMatcher | None], drafts: Sequence[Draft]
    ) -> PendingMasks:
        """Start filling masks for ``drafts`` (``matchers[b]`` None = unconstrained request)."""
        rows = sum(d.num_nodes for d, m in zip(drafts, matchers) if m is not None)
        bitmask = self._rows(rows) if rows else None
        mask_rows: list[int] = []
        parts: list[Future[tuple[np.ndarray, np.ndarray]] | int] = []
        row = 0
        for matcher, draft in zip(matchers, drafts):
            n = draft.num_nodes
            if matcher is None or bitmask is None:
                mask_rows.extend([-1] * n)
                parts.append(n)
                continue
            out = bitmask[row : row + n]
            parts.append(self._pool.submit(self._fill_one, matcher, draft, out))
            mask_rows.extend(range(row, row + n))
            row += n
        return PendingMasks(bitmask, torch.tensor(mask_rows, dtype=torch.int64), parts)

    def _fill_one(
        self, matcher: GrammarMatcher, draft: Draft, out: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        from espalier.constrained.traverse import fill_tree_bitmask
        from espalier.constrained.tree import DraftTree

        tree = DraftTree(draft.tokens, *sibling_links(draft.parents))
        result = fill_tree_bitmask(matcher, tree, out, self.budget_s)
        return result.valid, result.filled
