"""One speculative decoding step over a batch: draft, verify (masks overlapped), compact KV.

The caller (the engine's :class:`~espalier.engine.spec.strategy.SpeculativeDecoding`, or
:mod:`tests.fixtures.spec_loop`) owns the requests and their KV blocks. Per step and request
that samples, it passes a :class:`SpecSeq`: every known token, how many of them the cache holds
(``context_len``), the block table, the grammar matcher (it has accepted every known token but
``behind``), the speculation settings and the sampling parameters (None = greedy).

- Decoding (``context_len == len(tokens) - 1``): the last token is the tree's root; drafted
  nodes go below it. ``num_draft_tokens=0`` gives a root-only tree: exactly a plain decode step,
  so requests that do not speculate share the batch with ones that do.
- The last chunk of a prefill (``context_len < len(tokens) - 1``): fed causally, root-only tree.

Order of a step (:meth:`SpeculativeDecoder.launch`, then ``finish``):

1. drafting (CPU and/or draft model);
2. the caller grows each block table to cover the tree (``ensure_blocks``);
3. the verify forward launched and the tree masks filled on CPU threads and the calling thread
   meanwhile (on CUDA the launch comes first, on the CPU the fills start first), masks awaited;
4. greedy rows: fused masked greedy verification; sampled rows: lossless tree speculative
   sampling (``kernels.sampling``); → accepted path + bonus per request;
5. accepted nodes' K/V compacted into place (one ``copy_slots`` for the batch).

:meth:`~SpeculativeDecoder.launch` runs 1-3 up to the fills, :meth:`~SpeculativeDecoder.fill`
starts them and :meth:`~SpeculativeDecoder.finish` does the rest: a caller whose matchers are
still behind the tokens (``SpecSeq.behind``) launches, catches them up while the forward runs,
then fills.

The caller then appends the emitted tokens one by one (advancing the matcher, checking stops);
afterwards the cache holds every known token but the last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from espalier.engine.api import TokenLogprob
from espalier.engine.model.runner import SeqInput
from espalier.engine.spec.combine import ProposalItem, Proposer
from espalier.engine.spec.masks import MaskBuilder, PendingMasks
from espalier.engine.spec.tree_builder import Draft
from espalier.engine.spec.verify import (
    Acceptance,
    TreeMasks,
    acceptances,
    compaction_slots,
    tree_seq_input,
    tree_tensors,
    verify_greedy,
)

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarMatcher
    from espalier.engine.model.runner import ForwardOutput, ModelRunner


TARGET_SMOOTHING = 0.5
"""Weight of the past in :attr:`SpeculativeDecoder.target_s` (per step, exponential)."""


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters of one request (temperature > 0) and its generator."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None


@dataclass
class SpecSeq:
    """One request's share of a speculative step (see the module docstring)."""

    request_id: str
    tokens: Sequence[int]
    block_table: list[int]
    matcher: GrammarMatcher | None = None
    methods: tuple[str, ...] = ()
    num_draft_tokens: int = 0
    sampling: SamplingSpec | None = None
    context_len: int = -1  # -1 = len(tokens) - 1 (decoding)
    logprobs: int = 0  # top-n logprobs per emitted token (0 = none)
    max_drafted: int | None = None  # nodes the drafters may add (forced chains aside); None: all
    behind: Sequence[int] = ()  # the last tokens the matcher has not accepted yet (launch)

    def __post_init__(self) -> None:
        if self.context_len < 0:
            self.context_len = len(self.tokens) - 1

    @property
    def decoding(self) -> bool:
        return self.context_len == len(self.tokens) - 1


Lookahead = Callable[[Sequence["SpecSeq"], Sequence[Draft]], list[Callable[[np.ndarray], None]]]
"""Host jobs for a step's drafts, run on the mask threads after the fills (``step``)."""


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one step, shared by every request in it."""

    draft_s: float
    mask_s: float  # waiting for masks after the forward (the part not hidden by it)
    verify_s: float  # forward + verification + compaction


@dataclass(frozen=True)
class SeqOutcome:
    """What one request got from a step: its draft, the acceptance, and (when asked) one
    logprob entry per emitted token. ``fault``: the exception the request's own grammar raised
    while its tree was filled (the acceptance is then meaningless: the request must end)."""

    draft: Draft
    acceptance: Acceptance
    logprobs: list[TokenLogprob] = field(default_factory=list)
    fault: BaseException | None = None


@dataclass
class SpecLaunch:
    """A step between :meth:`SpeculativeDecoder.launch` and ``finish``: its sequences, drafts
    and forward inputs; ``out`` the forward's output (on CUDA still being computed),
    ``pending`` the fills (None: not started), ``draft_s`` / ``launch_s`` the seconds drafting
    and launching took."""

    seqs: Sequence[SpecSeq]
    drafts: list[Draft]
    inputs: list[SeqInput]
    passthrough: Sequence[tuple[str, SeqInput]]
    lookahead: Lookahead | None
    draft_s: float
    out: ForwardOutput | None = None
    launch_s: float = 0.0
    pending: PendingMasks | None = None


class SpeculativeDecoder:
    """Runs speculative steps against one target ``ModelRunner``."""

    def __init__(
        self,
        runner: ModelRunner,
        proposer: Proposer,
        masks: MaskBuilder,
        *,
        launch_first: bool | None = None,
    ) -> None:
        """launch_first: launch the verify forward before starting the mask fills (None = on
        CUDA only; see below)."""
        self.runner = runner
        self.proposer = proposer
        self.masks = masks

        self._observers = [
            d for d in proposer.drafters.values() if getattr(d, "hidden_layers", None)
        ]
        layers: set[int] = set()
        for drafter in self._observers:
            layers.update(drafter.hidden_layers)  # type: ignore[attr-defined]
        self._hidden_layers = tuple(sorted(layers))
        # CUDA: the forward only launches (asynchronous), so the fills start after it and run
        # while the GPU works, instead of competing with the launch's Python for the GIL; but
        # not when it runs eagerly (no CUDA graph fits the step, ``ModelRunner.replays``): that
        # launch takes as long as the fills or longer (docs/decisions/padded-tree-graphs.md).
        # CPU: the forward runs to
        # completion inside the call (releasing the GIL in its kernels), so the fills start
        # before it to overlap with it.
        self._launch_first = runner.device.type == "cuda" if launch_first is None else launch_first
        self._copy_stream: torch.cuda.Stream | None = None  # mask uploads (CUDA, _upload)
        # the target's time per step (forward + verification), smoothed: how long this step's
        # fills run alongside the forward, so their budget may stretch to it (MaskBuilder.submit)
        self.target_s = 0.0

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)

    def prefill(self, passthrough: Sequence[tuple[str, SeqInput]]) -> None:
        """A forward of prefill chunks only (no logits); drafters see their features."""
        out = self.runner.forward([i for _, i in passthrough], hidden_layers=self._hidden_layers)
        if self._observers:
            self._observe(out.hidden_states, [], [], [], passthrough)

    def _observe(
        self,
        hidden: dict[int, torch.Tensor],
        seqs: Sequence[SpecSeq],
        inputs: Sequence[SeqInput],
        accepted: Sequence[Acceptance],
        passthrough: Sequence[tuple[str, SeqInput]],
    ) -> None:
        """Hand the target features of verified positions to the drafters that read them."""
        row = 0
        jobs: list[tuple[str, int, torch.Tensor]] = []
        for seq, item, acc in zip(seqs, inputs, accepted):
            if seq.decoding:
                rows = [row + node for node in acc.path]
            else:
                rows = list(range(row, row + item.q_len))
            jobs.append((seq.request_id, seq.context_len, torch.tensor(rows)))
            row += item.q_len
        for request_id, item in passthrough:
            jobs.append((request_id, item.context_len, torch.arange(row, row + item.q_len)))
            row += item.q_len
        for request_id, start, rows_t in jobs:
            index = rows_t.to(self.runner.device)
            captured = {layer: h.index_select(0, index) for layer, h in hidden.items()}
            for drafter in self._observers:
                drafter.observe(request_id, start, captured)  # type: ignore[attr-defined]

    def launch(
        self,
        seqs: Sequence[SpecSeq],
        ensure_blocks: Callable[[SpecSeq, int], None],
        passthrough: Sequence[tuple[str, SeqInput]] = (),
        lookahead: Lookahead | None = None,
        *,
        fill_first: bool = True,
    ) -> SpecLaunch:
        """Draft ``seqs``' trees and launch their verify forward; ``finish`` completes the step.
        ``ensure_blocks(seq, n)`` must make ``seq.block_table`` cover ``n`` cache entries (the
        caller allocates; when it cannot, the draft is cut to what the table covers).
        ``passthrough``: ``(request_id, input)`` of other sequences of the same forward that
        want no logits (prefill chunks); they go after ``seqs``. ``lookahead``: given the
        drafts, host jobs to run on the mask threads after the fills (called before any fill
        starts; e.g. the engine's closing decisions, ``engine/closing/ahead.py``).
        ``fill_first``: the fills start here (before the forward or after it, as
        ``launch_first`` says); else the caller starts them with :meth:`fill` once the matchers
        have accepted every token of ``seq.tokens`` (``SpecSeq.behind`` says which they have
        not yet). A request whose grammar raises in its fill gets an outcome with ``fault``
        set."""
        start = time.perf_counter()
        drafts = self._propose(seqs)
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            ensure_blocks(seq, seq.context_len + draft.num_nodes)
            room = len(seq.block_table) * self.runner.block_size - seq.context_len
            if draft.num_nodes > room:  # the cache is full: verify fewer nodes
                from espalier.engine.spec.tree_builder import select_top

                drafts[i] = select_top(draft, max(room - 1, 0))
        drafted = time.perf_counter()
        # the inputs before the fills start: they would compete with them for the GIL
        inputs = [_seq_input(s, d) for s, d in zip(seqs, drafts)]
        launched = SpecLaunch(seqs, drafts, inputs, passthrough, lookahead, drafted - start)
        batch = [*inputs, *(i for _, i in passthrough)]
        # an eager forward's call lasts as long as its launch from Python: the fills go first,
        # unless every tree is its root alone (a prefill's last chunk, a plain step): one row
        # each, filled in far less time than the launch, whose Python they would only slow
        launch_first = self._launch_first and (
            all(d.num_nodes == 1 for d in drafts)
            or self.runner.replays(batch, hidden_layers=self._hidden_layers)
        )
        if fill_first and not launch_first:
            self.fill(launched)
        launched.out = self.runner.forward(batch, hidden_layers=self._hidden_layers)
        if fill_first and launch_first:
            self.fill(launched)
        launched.launch_s = time.perf_counter() - drafted
        return launched

    def fill(self, launched: SpecLaunch, live: Sequence[bool] | None = None) -> None:
        """Start the launch's mask fills and its lookahead jobs; ``live[i]`` False: seq ``i``
        ended since the launch, its tree is left unmasked (its outcome is never used)."""
        seqs, drafts = launched.seqs, launched.drafts
        matchers = [s.matcher if live is None or live[i] else None for i, s in enumerate(seqs)]
        lookahead = launched.lookahead
        after = lookahead(seqs, drafts) if lookahead is not None else []
        launched.pending = self.masks.submit(matchers, drafts, after, hidden_s=self.target_s)

    def finish(self, launched: SpecLaunch) -> tuple[list[SeqOutcome], StepTimes]:
        """Wait for the launch's forward and masks; verify, and compact the accepted K/V."""
        if launched.pending is None:
            self.fill(launched)
        pending, out = launched.pending, launched.out
        assert pending is not None and out is not None
        seqs, drafts, inputs = launched.seqs, launched.drafts, launched.inputs
        waiting = time.perf_counter()
        masks = self._upload(pending.result())
        masked = time.perf_counter()
        accepted = self._verify(out.logits, seqs, drafts, masks)
        logprobs = self._logprobs(out.logits, seqs, drafts, masks, accepted)
        if self._observers:
            self._observe(out.hidden_states, seqs, inputs, accepted, launched.passthrough)
        src: list[int] = []
        dst: list[int] = []
        for seq, acc in zip(seqs, accepted):
            if seq.decoding:
                s, d = compaction_slots(
                    seq.block_table, self.runner.block_size, seq.context_len, acc.path
                )
                src.extend(s)
                dst.extend(d)
        self.runner.copy_slots(src, dst)
        done = time.perf_counter()
        times = StepTimes(
            draft_s=launched.draft_s,
            mask_s=masked - waiting,
            verify_s=launched.launch_s + (done - masked),
        )
        self.target_s = TARGET_SMOOTHING * self.target_s + (1 - TARGET_SMOOTHING) * times.verify_s
        faults = pending.faults()
        outcomes = [
            SeqOutcome(d, a, lp, faults.get(i))
            for i, (d, a, lp) in enumerate(zip(drafts, accepted, logprobs))
        ]
        return outcomes, times

    def _upload(self, masks: TreeMasks) -> TreeMasks:
        """On CUDA: the bitmask copied to the device on a side stream, which the compute stream
        waits for. The copy (M rows of V/8 bytes: ~9 MB for 288 Gemma rows) then overlaps the
        forward still running, instead of queueing after it. Elsewhere: ``masks`` as they are.

        The pinned buffer is not written again before the step's host sync (``MaskBuilder``),
        which comes after the copy."""
        if masks.bitmask is None or self.runner.device.type != "cuda":
            return masks
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.runner.device)
        compute = torch.cuda.current_stream(self.runner.device)
        with torch.cuda.stream(self._copy_stream):
            bitmask = masks.bitmask.to(self.runner.device, non_blocking=True)
        compute.wait_stream(self._copy_stream)
        bitmask.record_stream(compute)  # allocated on the copy stream, used on this one
        return replace(masks, bitmask=bitmask)

    def _propose(self, seqs: Sequence[SpecSeq]) -> list[Draft]:
        drafts = [Draft.root_only(s.tokens[-1]) for s in seqs]
        wanted = [i for i, s in enumerate(seqs) if s.decoding and s.num_draft_tokens > 0]
        if wanted:
            items = [
                ProposalItem(
                    seqs[i].request_id,
                    seqs[i].tokens,
                    seqs[i].matcher,
                    seqs[i].methods,
                    seqs[i].num_draft_tokens,
                    seqs[i].max_drafted,
                    seqs[i].behind,
                )
                for i in wanted
            ]
            for i, draft in zip(wanted, self.proposer.propose(items)):
                drafts[i] = draft
        return drafts

    def _verify(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SpecSeq],
        drafts: list[Draft],
        masks: TreeMasks,
    ) -> list[Acceptance]:
        vocab = self.runner.vocab_size
        result = verify_greedy(logits, drafts, masks, vocab)
        roots = np.cumsum([0] + [d.num_nodes for d in drafts[:-1]]).tolist()
        filled = masks.filled[roots].tolist() if roots else []
        sampled = [i for i, s in enumerate(seqs) if s.sampling is not None]
        # a root-only tree is a plain decode step: its draw is the plain sampler's, from the
        # same stream (a seeded request that does not speculate gets the tokens it gets in a
        # plain step, whatever shares the batch); the tree sampler draws otherwise
        alone = [i for i in sampled if drafts[i].num_nodes == 1 and filled[i]]
        trees = [i for i in sampled if drafts[i].num_nodes > 1 or not filled[i]]
        if alone:
            for i, token in zip(alone, self._sample_roots(logits, seqs, masks, roots, alone)):
                result[i] = Acceptance(path=[0], tokens=[token], forced=0)
        if trees:
            for i, acc in zip(trees, self._sample(logits, seqs, drafts, masks, trees)):
                result[i] = acc
        return result

    def _sample_roots(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SpecSeq],
        masks: TreeMasks,
        roots: list[int],
        rows: list[int],
    ) -> list[int]:
        """One token per request of ``rows`` (root-only trees) from its root's logits, drawn
        by the plain :class:`~espalier.engine.sampler.Sampler` (its noise, its filters)."""
        from espalier.engine.sampler import RowParams, Sampler

        index = torch.tensor([roots[i] for i in rows], dtype=torch.int64)
        sub = logits.index_select(0, index.to(logits.device)).float()
        mask_rows = masks.mask_rows[index]
        masked = [j for j, row in enumerate(mask_rows.tolist()) if row >= 0]
        bitmask = None
        if masked and masks.bitmask is not None:
            bitmask = masks.bitmask[mask_rows.clamp_min(0)].to(logits.device)
        params = []
        for i in rows:
            spec = seqs[i].sampling
            assert spec is not None, "rows are the sampled requests"
            params.append(
                RowParams(spec.temperature, spec.top_k, spec.top_p, spec.min_p, spec.generator)
            )
        return Sampler()(sub, params, bitmask=bitmask, masked_rows=masked).token_ids

    def _logprobs(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SpecSeq],
        drafts: list[Draft],
        masks: TreeMasks,
        accepted: list[Acceptance],
    ) -> list[list[TokenLogprob]]:
        """Per emitted token, ``log_softmax`` of the grammar-masked logits of the node it was
        chosen at (before temperature and truncation, as in the plain sampler)."""
        from espalier.kernels.reference import node_allowed

        out: list[list[TokenLogprob]] = [[] for _ in seqs]
        want = [i for i, s in enumerate(seqs) if s.logprobs > 0 and accepted[i].tokens]
        if not want:
            return out
        offsets = [0]
        for draft in drafts:
            offsets.append(offsets[-1] + draft.num_nodes)
        rows = [offsets[i] + n for i in want for n in accepted[i].path[: len(accepted[i].tokens)]]
        index = torch.tensor(rows, dtype=torch.int64)
        sub = logits.index_select(0, index.to(logits.device)).float()
        bitmask = None if masks.bitmask is None else masks.bitmask.to(logits.device)
        allowed = node_allowed(
            sub.shape[1],
            len(rows),
            bitmask,
            masks.mask_rows[index].to(logits.device),
            self.runner.vocab_size,
            logits.device,
        )
        lp = torch.log_softmax(sub.masked_fill(~allowed, float("-inf")), dim=-1)
        top_n = max(seqs[i].logprobs for i in want)
        top_v, top_i = lp.topk(top_n, dim=-1)
        tokens = [t for i in want for t in accepted[i].tokens]
        chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0]
        # host sync: logprobs go back to python with the emitted tokens
        chosen_l, top_v_l, top_i_l = chosen.tolist(), top_v.tolist(), top_i.tolist()
        r = 0
        for i in want:
            n = seqs[i].logprobs
            for token in accepted[i].tokens:
                top = tuple(zip(top_i_l[r][:n], top_v_l[r][:n]))
                out[i].append(TokenLogprob(token, chosen_l[r], top))
                r += 1
        return out

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SpecSeq],
        drafts: list[Draft],
        masks: TreeMasks,
        rows: list[int],
    ) -> list[Acceptance]:
        """Tree speculative sampling for the sampled requests ``rows`` (drafts are deterministic:
        each drafted child counts as a one-hot proposal, which keeps the output exact)."""
        from espalier.kernels.sampling import SamplingTensors, tree_speculative_sample

        device = logits.device
        offsets = [0]
        for draft in drafts:
            offsets.append(offsets[-1] + draft.num_nodes)
        node_index = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in rows])
        sub = [drafts[i] for i in rows]
        first_child, next_sibling, tokens, sub_offsets = tree_tensors(sub)
        specs: list[SamplingSpec] = []
        for i in rows:
            spec = seqs[i].sampling
            assert spec is not None, "rows are the sampled requests"
            specs.append(spec)
        params = SamplingTensors(
            torch.tensor([s.temperature for s in specs], dtype=torch.float32, device=device),
            torch.tensor([s.top_k for s in specs], dtype=torch.int64, device=device),
            torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device),
            torch.tensor([s.min_p for s in specs], dtype=torch.float32, device=device),
        )
        generators = [s.generator or torch.Generator(device=device) for s in specs]
        idx = node_index.to(device)
        result = tree_speculative_sample(
            logits.index_select(0, idx),
            first_child.to(device),
            next_sibling.to(device),
            tokens.to(device),
            sub_offsets,
            params,
            generators,
            bitmask=None if masks.bitmask is None else masks.bitmask.to(device),
            mask_rows=masks.mask_rows[node_index].to(device),
            valid=masks.valid[node_index].to(device),
            filled=masks.filled[node_index].to(device),
        )
        return acceptances(sub, result.path, result.accept_length, result.bonus_token)


def _seq_input(seq: SpecSeq, draft: Draft) -> SeqInput:
    if seq.decoding:
        return tree_seq_input(draft, seq.block_table, seq.context_len)
    new = list(seq.tokens[seq.context_len :])
    return SeqInput(seq.block_table, new, seq.context_len, logits="last")
