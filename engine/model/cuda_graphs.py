"""CUDA graphs for decode steps and tree verification: one captured forward per step shape.

A shape is ``(bucket, n)``: ``bucket`` sequences of ``n`` new tokens each. ``n = 1`` is a plain
decode step (causal); ``n`` in ``tree_sizes`` is a verification step whose every sequence feeds a
draft tree of at most ``n`` nodes (custom masks, positions by depth, logits for every node), or
one token. A step replays the graph of the smallest captured tree size that holds its largest
tree, then of the smallest bucket >= its batch; smaller trees are padded with dummy rows
(``engine/model/graph_padding.py``). Other steps (prefill chunks, trees larger than every captured
size, inner-layer hidden states, bigger batches) run eagerly.

Captured: embedding -> decoder layers (K/V writes + flashinfer attention) -> final norm into a
static hidden-state buffer ``[bucket * n, hidden]``; the LM head runs eagerly after the replay
(one GEMM over the rows that want logits). Inputs live in a static int64 ``[3, bucket * n]``
device buffer (token ids, rope positions, cache slots) filled by one host-to-device copy. A batch
of ``b < bucket`` pads with dummy sequences of ``n`` tokens written into a reserved scratch block
(the cache's last block, never handed to the scheduler), attending causally among themselves;
their rows are dropped. flashinfer's wrappers are in CUDA-graph mode per shape (fixed index and
packed-mask buffers) and re-planned on the host before each replay, outside the graph. A shape
whose capture fails is dropped with a logged reason; its steps run eagerly.

Planning ahead: a decode shape is captured twice (two graphs, two sets of
wrappers). While one replays, the other is planned for the step that most likely follows (the
same sequences one token further, when their block tables already cover it), on a side stream:
flashinfer's plan copies from pageable host memory, which waits for the stream it is issued on
(planned on the replaying stream, the call lasted the whole step). A step whose layout is the
one planned ahead replays that graph without planning; any other step plans as before. Without
this the GPU idles through each plan, between one step's sync and the next replay (numbers:
``docs/decisions/flashinfer-plan-and-kernels.md``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from espalier.engine.model.attention.base import AttentionMetadata
from espalier.engine.model.graph_padding import PaddedStep, pad_step, padded_layout, step_tokens

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from espalier.engine.model.attention.flashinfer import FlashinferBackend, GraphWrappers
    from espalier.engine.model.runner import ForwardOutput, ModelRunner, SeqInput

log = logging.getLogger(__name__)

Shape = tuple[int, int]  # (sequences, new tokens per sequence)
LayoutKey = tuple[tuple[int, tuple[int, ...]], ...]  # per sequence: context_len, pages used


@dataclass
class _Graph:
    """One captured shape. inputs: int64 ``[3, bucket * n]`` (tokens, positions, slots), device;
    hidden: the captured forward's output ``[bucket * n, hidden]`` (model dtype)."""

    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor
    hidden: torch.Tensor
    wrappers: GraphWrappers
    planned: LayoutKey | None = None  # the decode layout planned ahead (None: plan first)
    plan_ready: torch.cuda.Event | None = None  # that plan's copies, on the side stream
    replayed: torch.cuda.Event | None = None  # after this graph's last replay


class StepGraphs:
    """Captures and replays decode and tree-verify forwards of ``runner`` (flashinfer, CUDA)."""

    def __init__(
        self,
        runner: ModelRunner,
        batch_sizes: Sequence[int],
        tree_sizes: Sequence[int],
        scratch_block: int,
    ) -> None:
        self.runner = runner
        self.backend: FlashinferBackend = runner.attention  # type: ignore[assignment]
        self.batch_sizes = sorted({b for b in batch_sizes if b > 0})
        # a dummy sequence's tokens must fit in the scratch block
        self.tree_sizes = sorted({n for n in tree_sizes if 1 < n <= runner.block_size})
        self.scratch_block = scratch_block
        self.graphs: dict[Shape, _Graph] = {}
        self.spares: dict[int, _Graph] = {}  # bucket -> the second decode graph (planned ahead)
        self._plan_stream: torch.cuda.Stream | None = None
        self.planned_ahead = 0  # decode steps that found their plan made during the last one
        self.failures: dict[Shape, str] = {}
        self.replays: dict[int, int] = {}  # tokens per sequence -> replays
        self.padded_replays: dict[int, int] = {}  # the replays with smaller trees padded
        self.prepare_s = 0.0  # host seconds spent planning and copying inputs before replays

    @property
    def captured(self) -> list[Shape]:
        return sorted(self.graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every shape, largest first per ``n`` (smaller ones reuse its memory pool)."""
        pool: _POOL_HANDLE | None = None
        for n in [1, *self.tree_sizes]:
            for bucket in reversed(self.batch_sizes):
                try:
                    graph = self._capture_one(bucket, n, pool)
                except Exception as exc:  # any capture failure: that shape runs eagerly
                    self.failures[(bucket, n)] = f"{type(exc).__name__}: {exc}"
                    log.warning(
                        "CUDA graph for %d x %d tokens not captured (%s); eager instead",
                        bucket,
                        n,
                        self.failures[(bucket, n)],
                    )
                    continue
                pool = graph.graph.pool()
                self.graphs[(bucket, n)] = graph
                if n == 1:
                    try:
                        self.spares[bucket] = self._capture_one(bucket, n, pool)
                    except Exception as exc:  # plan this bucket after each sync instead
                        log.warning("no second decode graph for %d: %s", bucket, exc)

    def _capture_one(self, bucket: int, n: int, pool: _POOL_HANDLE | None) -> _Graph:
        runner, device = self.runner, self.runner.device
        bs = runner.block_size
        max_pages = runner.kv_cache.num_blocks + bucket
        mask_bytes = 0
        if n > 1:  # room for every sequence's packed [n, kv_len] mask at the longest kv_len
            max_kv = min(runner.model_config.max_position_embeddings, max_pages * bs)
            mask_bytes = bucket * (-(-n * max_kv // 8))
        inputs = torch.zeros((3, bucket * n), dtype=torch.int64, device=device)
        wrappers = self.backend.graph_wrappers(bucket, max_pages, n, mask_bytes)
        empty = self._pad([], bucket, n)  # all dummy sequences
        self._plan(wrappers, empty)
        inputs.copy_(empty.inputs)
        meta = _static_metadata(inputs, bucket, n, bs, device, wrappers)

        def run() -> torch.Tensor:
            hidden, _ = runner.model(inputs[0], inputs[1], meta, runner.kv_cache, self.backend)
            return hidden

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the graph (lazy init, JIT, caches)
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = run()
        return _Graph(graph, inputs, hidden, wrappers)

    # -- replay ------------------------------------------------------------------------------------

    def forward(
        self, batch: Sequence[SeqInput], hidden_layers: Sequence[int]
    ) -> ForwardOutput | None:
        """The step's output through a graph replay, or None when no graph fits the step."""
        from espalier.engine.model.runner import ForwardOutput

        fit = self._fit(batch, hidden_layers)
        if fit is None:
            return None
        bucket, n = fit
        graph = self.graphs[(bucket, n)]
        started = time.perf_counter()
        step = self._pad(batch, bucket, n)
        ahead = self._planned_for(bucket, batch) if n == 1 else None
        if ahead is not None:
            graph = ahead
            self.planned_ahead += 1
        else:
            graph.planned = None
            if graph.plan_ready is not None:  # its last plan ahead fed copies from the pinned
                graph.plan_ready.synchronize()  # host buffers this plan rewrites (long done)
            try:
                self._plan(graph.wrappers, step)
            except ValueError:  # more pages or mask bytes than the fixed buffers hold: eager
                return None
        graph.inputs.copy_(step.inputs, non_blocking=True)
        self.prepare_s += time.perf_counter() - started
        graph.graph.replay()
        self.replays[n] = self.replays.get(n, 0) + 1
        if step.padded:
            self.padded_replays[n] = self.padded_replays.get(n, 0) + 1
        logits = self.runner.model.compute_logits(_take(graph.hidden, step.logits_rows))
        captured = {}
        if hidden_layers:  # the output buffer is the next replay's: a copy
            rows = _take(graph.hidden, step.rows)
            captured[self.runner.model_config.num_layers] = (
                rows.clone() if rows.data_ptr() == graph.hidden.data_ptr() else rows
            )
        if n == 1 and bucket in self.spares:  # the GPU is busy with this step meanwhile
            self._plan_ahead(graph, batch, bucket)
        return ForwardOutput(
            logits=logits, logits_indptr=step.logits_indptr, hidden_states=captured
        )

    def fits(self, batch: Sequence[SeqInput], hidden_layers: Sequence[int]) -> bool:
        """Whether :meth:`forward` would replay a graph for this step (host work only; a plan
        that overflows the fixed buffers still runs eagerly)."""
        return self._fit(batch, hidden_layers) is not None

    def _fit(self, batch: Sequence[SeqInput], hidden_layers: Sequence[int]) -> Shape | None:
        """The captured shape ``(bucket, n)`` this step replays: for a decode step ``n = 1``,
        else the smallest tree size that holds its largest tree (smaller trees padded,
        ``graph_padding``), then the smallest bucket; None: it runs eagerly."""
        final = self.runner.model_config.num_layers
        m = step_tokens(batch)
        if m is None or any(layer != final for layer in hidden_layers):
            return None
        shapes = ((k, b) for b, k in self.captured if b >= len(batch))
        fits = sorted((k, b) for k, b in shapes if (k == 1) == (m == 1) and k >= m)
        return (fits[0][1], fits[0][0]) if fits else None

    def _planned_for(self, bucket: int, batch: Sequence[SeqInput]) -> _Graph | None:
        """The graph of ``bucket`` planned ahead for the decode step ``batch``, made ready to
        replay (the current stream waits for its plan's copies); None when there is none."""
        if bucket not in self.spares:
            return None
        key = _layout_key(batch, self.runner.block_size)
        for graph in (self.graphs[(bucket, 1)], self.spares[bucket]):
            if graph.planned == key and graph.plan_ready is not None:
                torch.cuda.current_stream().wait_event(graph.plan_ready)
                graph.planned = None  # one use: its buffers are the replay's from now on
                return graph
        return None

    def _plan_ahead(self, current: _Graph, batch: Sequence[SeqInput], bucket: int) -> None:
        """Plan the other graph of ``bucket`` for the decode step after ``batch`` (each sequence
        one token further) on the side stream, while ``current`` replays; nothing when a block
        table does not cover that step yet."""
        from espalier.engine.model.runner import SeqInput

        current.replayed = current.replayed or torch.cuda.Event()
        current.replayed.record()  # after the replay and the LM head launched behind it
        bs = self.runner.block_size
        if any(len(s.block_table) * bs < s.context_len + 2 for s in batch):
            return
        primary = self.graphs[(bucket, 1)]
        other = self.spares[bucket] if current is primary else primary
        if other.replayed is not None:
            # its last replay reads the buffers (and flashinfer's pinned host buffers feed the
            # copies) this plan rewrites; it ended before the previous step's sync
            other.replayed.synchronize()
        following = [SeqInput(s.block_table, (0,), s.context_len + 1) for s in batch]
        stream = self._plan_stream = self._plan_stream or torch.cuda.Stream(self.runner.device)
        other.planned = None
        try:
            with torch.cuda.stream(stream):
                layout = padded_layout(
                    following, bucket, 1, block_size=bs, scratch_block=self.scratch_block
                )
                self.backend.plan_causal(other.wrappers.wrappers, layout, bs)
        except ValueError:  # does not fit the fixed buffers: that step will plan (and fail)
            return
        other.plan_ready = other.plan_ready or torch.cuda.Event()
        other.plan_ready.record(stream)
        other.planned = _layout_key(following, bs)

    def _pad(self, batch: Sequence[SeqInput], bucket: int, n: int) -> PaddedStep:
        return pad_step(
            batch,
            bucket,
            n,
            block_size=self.runner.block_size,
            scratch_block=self.scratch_block,
            windows=self.backend.windows,
        )

    def _plan(self, wrappers: GraphWrappers, step: PaddedStep) -> None:
        bs = self.runner.block_size
        layout = step.layout(bs)
        if step.masks is None:
            self.backend.plan_causal(wrappers.wrappers, layout, bs)
        else:
            self.backend.plan_graph_masked(wrappers, layout, bs, step.masks)


def _layout_key(batch: Sequence[SeqInput], block_size: int) -> LayoutKey:
    """What a decode step's plan depends on: per sequence its context and the pages it uses."""
    return tuple(
        (s.context_len, tuple(s.block_table[: s.context_len // block_size + 1])) for s in batch
    )


def _take(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``hidden[rows]``: a view when ``rows`` are the first ones in order, else a gather."""
    if rows == list(range(len(rows))):
        return hidden[: len(rows)]
    index = torch.tensor(rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
    return hidden.index_select(0, index)


def _static_metadata(
    inputs: torch.Tensor,
    bucket: int,
    n: int,
    block_size: int,
    device: torch.device,
    wrappers: GraphWrappers,
) -> AttentionMetadata:
    """Metadata whose device tensors are the graph's static inputs (the rest is the padded
    capture layout; only ``slot_mapping`` and ``backend_state`` are read inside the graph)."""
    return AttentionMetadata(
        token_ids=inputs[0],
        positions=inputs[1],
        slot_mapping=inputs[2],
        q_indptr=list(range(0, bucket * n + 1, n)),
        context_lens=[0] * bucket,
        kv_lens=[n] * bucket,
        block_tables=[[0]] * bucket,
        positions_list=[list(range(n))] * bucket,
        custom_masks=[None] * bucket,
        logits_rows=torch.arange(bucket * n, device=device),
        logits_indptr=list(range(0, bucket * n + 1, n)),
        block_size=block_size,
        device=device,
        backend_state=wrappers.wrappers,
    )
