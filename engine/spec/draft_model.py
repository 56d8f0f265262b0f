"""Draft-model drafter: a smaller model with the target's tokenizer grows an EAGLE-2-style tree.

Per request the drafter keeps its own paged KV cache (its own ``ModelRunner`` and allocator) in
step with the target: the cache holds the verified tokens ``0 .. computed-1``. Each step:

1. **draft extend**: feed the verified tokens it has not seen yet (the tokens accepted by the last
   verification plus the bonus token, which is the new root) and the forced chain (``extra``, not
   verified: written after the verified entries and overwritten later); logits at the last one;
2. **expand** for ``steps`` steps (EAGLE-2, Li et al. 2024, "dynamic draft trees"): the ``topk``
   best children of each frontier node join the tree with cumulative log-probability scores; the
   ``topk`` best new nodes form the next frontier and are fed in one forward (tree attention:
   each sees the context, its ancestors and itself; position = anchor position + depth);
3. **rerank**: keep the ``budget`` best-scoring nodes (``select_top``).

Rejected nodes need no freeing: only the verified prefix counts, later writes overwrite the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from espalier.engine.kv_cache import BlockAllocator, blocks_needed
from espalier.engine.model.runner import SeqInput
from espalier.engine.spec.base import DraftInput
from espalier.engine.spec.tree_builder import Draft, NodeSource, TreeBuilder, ancestor_matrix

if TYPE_CHECKING:
    from espalier.engine.model.runner import ModelRunner


@dataclass(frozen=True)
class DraftModelConfig:
    """topk: children per expanded node and frontier width; steps: expansion rounds (depth)."""

    topk: int = 4
    steps: int = 4

    def __post_init__(self) -> None:
        if self.topk < 1 or self.steps < 1:
            raise ValueError(f"invalid draft model config {self}")


@dataclass
class _Seq:
    """One request's draft-side state: its blocks and how many verified tokens they hold."""

    block_table: list[int] = field(default_factory=list)
    computed: int = 0
    context: list[int] = field(default_factory=list)


@dataclass
class _Job:
    """One request's expansion in progress."""

    seq: _Seq
    builder: TreeBuilder
    base: int  # cache index of the tree root (the anchor)
    frontier: list[int] = field(default_factory=list)  # builder nodes to feed next
    cached: list[int] = field(default_factory=list)  # builder nodes in the cache, in order
    budget: int = 0


class DraftModelDrafter:
    """Batched EAGLE-2 tree drafting with a standalone draft model (see the module docstring)."""

    name = "draft"

    def __init__(self, runner: ModelRunner, config: DraftModelConfig | None = None) -> None:
        self.runner = runner
        self.config = config or DraftModelConfig()
        self.allocator = BlockAllocator(runner.num_blocks)
        self._seqs: dict[str, _Seq] = {}

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None and seq.block_table:
            self.allocator.free(seq.block_table)

    @torch.inference_mode()
    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        jobs = [self._start(i) for i in inputs]
        live = [j for j in jobs if j is not None]
        if live:
            self._extend([i for i, j in zip(inputs, jobs) if j is not None], live)
            for _ in range(self.config.steps - 1):
                live = [j for j in live if j.frontier]
                if not live:
                    break
                self._expand(live)
        drafts = []
        for item, job in zip(inputs, jobs):
            if job is None:
                anchor = (list(item.context) + list(item.extra))[-1]
                drafts.append(Draft.root_only(anchor))
            else:
                drafts.append(job.builder.build(item.budget))
        return drafts

    # -- steps ----------------------------------------------------------------------------------

    def _start(self, item: DraftInput) -> _Job | None:
        """Sync the request's state with its verified context; reserve blocks for the tree."""
        seq = self._seqs.setdefault(item.request_id, _Seq())
        context = item.context
        common = min(seq.computed, len(context))
        if common and seq.context[common - 1] != context[common - 1]:
            common = 0  # not a continuation (preempted and restarted): recompute
        seq.computed = min(common, len(context) + len(item.extra) - 1)  # feed at least one
        seq.context = list(context)
        full = len(context) + len(item.extra)
        nodes = 1 + self.config.steps * self.config.topk
        entries = full + nodes
        need = blocks_needed(entries, self.runner.block_size) - len(seq.block_table)
        if item.budget <= 0 or need > self.allocator.num_free_blocks:
            return None
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))
        anchor = (list(context) + list(item.extra))[-1]
        return _Job(seq, TreeBuilder(anchor), base=full - 1, budget=item.budget)

    def _extend(self, items: list[DraftInput], jobs: list[_Job]) -> None:
        """Feed unseen verified tokens + forced chain; children of the anchor from the last row."""
        batch = []
        for item, job in zip(items, jobs):
            seq = job.seq
            new = list(item.context[seq.computed :]) + list(item.extra)
            batch.append(SeqInput(seq.block_table, new, seq.computed, logits="last"))
        out = self.runner.forward(batch)
        for item, job in zip(items, jobs):
            job.seq.computed = len(item.context)
        self._grow(jobs, [[0] for _ in jobs], torch.log_softmax(out.logits, dim=-1))

    def _expand(self, jobs: list[_Job]) -> None:
        """Feed every job's frontier (tree attention), grow children from their rows."""
        batch = [self._frontier_input(job) for job in jobs]
        fed = [job.frontier for job in jobs]
        for job in jobs:
            job.cached = job.cached + job.frontier
        out = self.runner.forward(batch)
        self._grow(jobs, fed, torch.log_softmax(out.logits, dim=-1))

    def _frontier_input(self, job: _Job) -> SeqInput:
        """The frontier of ``job`` as one tree-attention input after its cached nodes (each node
        sees the context, the anchor, its cached ancestors and itself)."""
        nodes, cached = job.frontier, job.cached
        context_len = job.base + 1 + len(cached)
        anc = ancestor_matrix(job.builder.parents)
        order = [0, *cached, *nodes]
        sub = anc[nodes][:, order]  # [q, 1 + cached + q]: root, cached nodes, new nodes
        mask = torch.ones((len(nodes), context_len + len(nodes)), dtype=torch.bool)
        mask[:, job.base :] = sub
        return SeqInput(
            job.seq.block_table,
            [job.builder.tokens[n] for n in nodes],
            context_len,
            positions=[job.base + self._depth(job.builder, n) for n in nodes],
            custom_mask=mask,
            logits="all",
        )

    def _grow(self, jobs: list[_Job], parents: list[list[int]], logp: torch.Tensor) -> None:
        """Add the top-k children of each fed node; the top-k new nodes become the frontier."""
        k = self.config.topk
        values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
        ids = self._map_ids(ids)
        # host sync: candidate tokens and scores go to python to build the trees
        values_l, ids_l = values.tolist(), ids.tolist()
        row = 0
        for job, fed in zip(jobs, parents):
            added: list[int] = []
            for node in fed:
                base = job.builder.scores[node]
                for value, token in zip(values_l[row], ids_l[row]):
                    before = job.builder.num_nodes
                    child = job.builder.add(node, token, base + value, NodeSource.MODEL)
                    if job.builder.num_nodes > before:
                        added.append(child)
                row += 1
            added.sort(key=lambda n: -job.builder.scores[n])
            job.frontier = added[:k]

    def _map_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Drafter vocabulary ids -> target ids (identity: same tokenizer)."""
        return ids

    @staticmethod
    def _depth(builder: TreeBuilder, node: int) -> int:
        depth = 0
        while node > 0:
            node = builder.parents[node]
            depth += 1
        return depth
