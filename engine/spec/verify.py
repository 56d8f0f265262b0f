"""Target-side tree verification: one forward over every tree token, masked greedy acceptance,
then KV compaction.

For one request with ``n`` known tokens (the last one, the root, not yet in the cache), its draft
tree of ``N`` nodes is fed at cache indices ``n-1 .. n-1+N-1`` with rope positions
``n-1 + depth`` and a mask "whole context + own ancestors + self" (``tree_attention_mask``); every
node gets a logits row: the target's distribution after the path root→node. The masked greedy
kernel (``espalier.kernels.verify.verify_greedy``) then walks from the root following the child
whose token is the parent's constrained argmax. Accepted nodes ``[0, a1..ak]`` move to cache
indices ``n-1 .. n-1+k`` (``compaction_slots``); everything after is garbage that later writes
overwrite. The emitted tokens are ``tokens[a1..ak] + [bonus]``: exactly what ``k + 1`` steps of
plain constrained greedy decoding would produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from espalier.engine.model.runner import SeqInput
from espalier.engine.spec.tree_builder import Draft, NodeSource, sibling_links, tree_attention_mask


@dataclass(frozen=True)
class TreeMasks:
    """Grammar masks of a verify batch (CPU; bitmask may be pinned, or already on the target's
    device: the decoder uploads it on CUDA).

    bitmask: int32 ``[M, W]`` or None (no request constrained).
    mask_rows: int64 ``[N]``: bitmask row of each node, -1 = unconstrained node.
    valid, filled: bool ``[N]``: the node's path is grammar-valid / its row was computed.
    """

    bitmask: torch.Tensor | None
    mask_rows: torch.Tensor
    valid: torch.Tensor
    filled: torch.Tensor


@dataclass(frozen=True)
class Acceptance:
    """Verification result of one request.

    path: accepted node ids, root first (``[0, a1, .., ak]``).
    tokens: the emitted tokens: the ``k`` accepted draft tokens, then the bonus token (if any:
        none when the last accepted node's mask row was not filled in time).
    forced: how many accepted draft tokens came from grammar-forced chains.
    """

    path: list[int]
    tokens: list[int]
    forced: int

    @property
    def accept_length(self) -> int:
        return len(self.path) - 1


def tree_seq_input(draft: Draft, block_table: Sequence[int], context_len: int) -> SeqInput:
    """The runner input feeding ``draft`` after ``context_len`` cached entries (logits for all)."""
    depths = draft.depths()
    if draft.num_nodes == 1:  # a chain of one: the plain decode step, causal mask suffices
        return SeqInput(block_table, [draft.tokens[0]], context_len, logits="all")
    return SeqInput(
        block_table=block_table,
        token_ids=draft.tokens,
        context_len=context_len,
        positions=[context_len + d for d in depths],
        custom_mask=tree_attention_mask(draft.parents, context_len),
        logits="all",
    )


def tree_tensors(
    drafts: Sequence[Draft],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Stacked ``first_child, next_sibling, tokens`` (int64 ``[N]``, CPU, local ids) and offsets."""
    first_children: list[int] = []
    next_siblings: list[int] = []
    tokens: list[int] = []
    offsets = [0]
    for draft in drafts:
        first_child, next_sibling = sibling_links(draft.parents)
        first_children.extend(first_child)
        next_siblings.extend(next_sibling)
        tokens.extend(draft.tokens)
        offsets.append(len(tokens))

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return t(first_children), t(next_siblings), t(tokens), offsets


def verify_greedy(
    logits: torch.Tensor,
    drafts: Sequence[Draft],
    masks: TreeMasks | None,
    vocab_size: int,
) -> list[Acceptance]:
    """Masked greedy verification of a batch of trees.

    logits: fp32 ``[N, V]`` on the target's device, rows in the order of the stacked drafts.
    """
    from espalier.kernels.verify import verify_greedy as kernel

    device = logits.device
    first_child, next_sibling, tokens, offsets = tree_tensors(drafts)
    bitmask = mask_rows = valid = filled = None
    if masks is not None:
        if masks.bitmask is not None:
            bitmask = masks.bitmask.to(device, non_blocking=True)
        mask_rows = masks.mask_rows.to(device, non_blocking=True)
        valid = masks.valid.to(device, non_blocking=True)
        filled = masks.filled.to(device, non_blocking=True)
    result = kernel(
        logits,
        first_child.to(device, non_blocking=True),
        next_sibling.to(device, non_blocking=True),
        tokens.to(device, non_blocking=True),
        offsets,
        vocab_size=vocab_size,
        bitmask=bitmask,
        mask_rows=mask_rows,
        valid=valid,
        filled=filled,
    )
    return acceptances(drafts, result.path, result.accept_length, result.bonus_token)


def acceptances(
    drafts: Sequence[Draft],
    path: torch.Tensor,
    accept_length: torch.Tensor,
    bonus_token: torch.Tensor,
) -> list[Acceptance]:
    """Per-request :class:`Acceptance` from a kernel's ``path [B, max_nodes]``, ``accept_length
    [B]`` and ``bonus_token [B]`` (-1 = none)."""
    # host sync: the accepted paths go back to python (grammar, KV bookkeeping), once per step
    paths = path.tolist()
    lengths = accept_length.tolist()
    bonuses = bonus_token.tolist()
    out = []
    for draft, nodes, length, bonus in zip(drafts, paths, lengths, bonuses):
        nodes = nodes[: length + 1]
        emitted = [draft.tokens[i] for i in nodes[1:]]
        if bonus >= 0:
            emitted.append(bonus)
        forced = sum(1 for i in nodes[1:] if draft.sources[i] == NodeSource.FORCED)
        out.append(Acceptance(path=nodes, tokens=emitted, forced=forced))
    return out


def compaction_slots(
    block_table: Sequence[int], block_size: int, context_len: int, path: Sequence[int]
) -> tuple[list[int], list[int]]:
    """``(src, dst)`` physical slots moving accepted node ``path[j]`` (cache index
    ``context_len + path[j]``) to cache index ``context_len + j``; unmoved nodes are skipped."""
    src: list[int] = []
    dst: list[int] = []
    for j, node in enumerate(path):
        if node == j:
            continue
        for index, out in ((context_len + node, src), (context_len + j, dst)):
            out.append(block_table[index // block_size] * block_size + index % block_size)
    return src, dst
