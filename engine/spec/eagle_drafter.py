"""EAGLE / EAGLE-3 drafter: the head drafts EAGLE-2 dynamic trees from the target's features.

The target's forwards capture the hidden states the head reads (``hidden_layers``); the
speculative decoder hands each request's features over with :meth:`EagleDrafter.observe` (prompt
positions at prefill, root + accepted nodes after each verification). Drafting then follows
:class:`~espalier.engine.spec.draft_model.DraftModelDrafter` (extend, ``steps`` rounds of top-k
expansion, rerank) with the head's pair alignment (``engine/spec/eagle.py``): the anchor sits at
draft cache index ``len(context) - 2``, and a node's input is its token with the head's own output
at its parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from espalier.engine.kv_cache import KVCache, blocks_needed
from espalier.engine.model.runner import SeqInput
from espalier.engine.spec.base import DraftInput
from espalier.engine.spec.draft_model import DraftModelConfig, DraftModelDrafter, _Job, _Seq
from espalier.engine.spec.eagle import EagleHead
from espalier.engine.spec.tree_builder import Draft, TreeBuilder

if TYPE_CHECKING:
    from espalier.engine.model.runner import ModelRunner


class EagleRunner:
    """The head + its paged KV cache; one batched forward per call (mirrors ``ModelRunner``)."""

    def __init__(self, head: EagleHead, target: ModelRunner, num_blocks: int) -> None:
        from espalier.engine.config import CacheConfig
        from espalier.engine.model.attention.base import get_attention_backend

        self.device, self.dtype = target.device, target.dtype
        self.head = head.to(device=self.device, dtype=self.dtype)
        self.target = target
        mc = head.config.model_config()
        cache = CacheConfig(block_size=target.block_size, num_blocks=num_blocks)
        self.kv_cache = KVCache.allocate(mc, cache, device=self.device, dtype=self.dtype)
        self.attention = get_attention_backend(target.config.attention_backend, mc)
        self.block_size, self.num_blocks = target.block_size, num_blocks

    @torch.inference_mode()
    def forward(
        self, batch: Sequence[SeqInput], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden ``[T, H]`` (fused inputs, one per new token) -> (output hidden ``[T, H]``,
        log-probabilities ``[n_logits, draft_vocab]`` fp32 of the requested rows)."""
        from espalier.engine.model.attention.base import build_metadata

        meta = build_metadata(batch, block_size=self.block_size, device=self.device)
        self.attention.prepare(meta)
        out = self.head(
            meta.token_ids,
            hidden.to(self.dtype),
            meta.positions,
            meta,
            self.kv_cache,
            self.attention,
        )
        rows = out.index_select(0, meta.logits_rows)
        logits = self.head.draft_logits(rows, self.target.model.compute_logits)
        return out, torch.log_softmax(logits, dim=-1)


@dataclass
class _Features:
    """Target features of one request for positions ``start .. start + len(rows) - 1``."""

    start: int = 0
    rows: torch.Tensor | None = None  # [n, F]

    @property
    def end(self) -> int:
        return self.start + (0 if self.rows is None else int(self.rows.shape[0]))

    def put(self, start: int, features: torch.Tensor) -> None:
        """Store features from position ``start`` on (overwriting what was there)."""
        if self.rows is None or not self.start <= start <= self.end:
            self.start, self.rows = start, features
        else:
            self.rows = torch.cat((self.rows[: start - self.start], features))

    def take(self, begin: int, end: int) -> torch.Tensor | None:
        """Rows of positions ``[begin, end)``; None unless all are known."""
        if self.rows is None or begin < self.start or end > self.end:
            return None
        return self.rows[begin - self.start : end - self.start]

    def drop_before(self, position: int) -> None:
        if self.rows is not None and position > self.start:
            self.rows = self.rows[min(position, self.end) - self.start :]
            self.start = min(position, self.end)


class EagleDrafter(DraftModelDrafter):
    """EAGLE-2 trees from an EAGLE / EAGLE-3 head (see the module docstring)."""

    name = "eagle"

    def __init__(
        self,
        head: EagleHead,
        target: ModelRunner,
        config: DraftModelConfig | None = None,
        *,
        num_blocks: int = 256,
    ) -> None:
        runner = EagleRunner(head, target, num_blocks)
        super().__init__(runner, config)  # type: ignore[arg-type]
        self.eagle = runner
        self.head = runner.head
        self.hidden_layers = head.config.target_layers(target.model_config.num_layers)
        self._features: dict[str, _Features] = {}
        self._node_hidden: dict[int, dict[int, torch.Tensor]] = {}

    # -- features from the target ----------------------------------------------------------------

    def observe(self, request_id: str, start: int, captured: dict[int, torch.Tensor]) -> None:
        """Target hidden states of positions ``start ..`` (``captured[layer]``: ``[n, H]``)."""
        features = torch.cat([captured[i] for i in self.hidden_layers], dim=-1)
        self._features.setdefault(request_id, _Features()).put(start, features)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._features.pop(request_id, None)

    # -- drafting ------------------------------------------------------------------------------

    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        try:
            return super().propose(inputs)
        finally:
            self._node_hidden.clear()

    def _start(self, item: DraftInput) -> _Job | None:
        m = len(item.context)
        features = self._features.get(item.request_id)
        seq = self._seqs.setdefault(item.request_id, _Seq())
        if seq.computed and (
            seq.computed > m - 1 or seq.context[seq.computed] != item.context[seq.computed]
        ):
            seq.computed = 0  # not a continuation (preempted, restarted): recompute
        if m < 2 or item.budget <= 0 or features is None or seq.computed > m - 2:
            return None
        if features.take(seq.computed, m - 1) is None:
            return None
        seq.context = list(item.context)
        base = m - 2 + len(item.extra)
        entries = base + 1 + self.config.steps * self.config.topk
        need = blocks_needed(entries, self.runner.block_size) - len(seq.block_table)
        if need > self.allocator.num_free_blocks:
            return None
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))
        anchor = (list(item.context) + list(item.extra))[-1]
        return _Job(seq, TreeBuilder(anchor), base=base, budget=item.budget)

    def _extend(self, items: list[DraftInput], jobs: list[_Job]) -> None:
        """Pairs up to the root (target features), then the forced chain (own features)."""
        batch: list[SeqInput] = []
        hidden: list[torch.Tensor] = []
        last: list[int] = []  # each sequence's last row in the forward's output
        for item, job in zip(items, jobs):
            seq, m = job.seq, len(item.context)
            feats = self._features[item.request_id].take(seq.computed, m - 1)
            assert feats is not None, "checked in _start"
            batch.append(
                SeqInput(
                    seq.block_table, item.context[seq.computed + 1 : m], seq.computed, logits="last"
                )
            )
            hidden.append(self.head.fuse(feats.to(self.eagle.device, self.eagle.dtype)))
            last.append((last[-1] if last else -1) + m - 1 - seq.computed)
            seq.computed = m - 1
            self._features[item.request_id].drop_before(m - 1)
        out, logp = self.eagle.forward(batch, torch.cat(hidden))
        anchor_hidden = [out[row] for row in last]
        rows = list(logp)
        chains = [list(item.extra) for item in items]
        for r in range(max(len(c) for c in chains)):
            sub = [j for j, c in enumerate(chains) if len(c) > r]
            chain_batch = [
                SeqInput(
                    jobs[j].seq.block_table,
                    [chains[j][r]],
                    len(items[j].context) - 1 + r,
                    logits="last",
                )
                for j in sub
            ]
            out, logp = self.eagle.forward(
                chain_batch, torch.stack([anchor_hidden[j] for j in sub])
            )
            for k, j in enumerate(sub):
                anchor_hidden[j], rows[j] = out[k], logp[k]
        for job, h in zip(jobs, anchor_hidden):
            self._node_hidden[id(job)] = {0: h}
        self._grow(jobs, [[0] for _ in jobs], torch.stack(rows))

    def _expand(self, jobs: list[_Job]) -> None:
        batch = [self._frontier_input(job) for job in jobs]
        fed = [job.frontier for job in jobs]
        hidden = torch.stack(
            [
                self._node_hidden[id(job)][job.builder.parents[node]]
                for job in jobs
                for node in job.frontier
            ]
        )
        for job in jobs:
            job.cached = job.cached + job.frontier
        out, logp = self.eagle.forward(batch, hidden)
        row = 0
        for job, nodes in zip(jobs, fed):
            for node in nodes:
                self._node_hidden[id(job)][node] = out[row]
                row += 1
        self._grow(jobs, fed, logp)

    def _map_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(ids)
