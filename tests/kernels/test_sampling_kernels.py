"""Constrained sampling and lossless tree speculative sampling."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from espalier.kernels import reference
from espalier.kernels.sampling import SamplingTensors, sample, tree_speculative_sample
from tests.fixtures.kernel_trees import batch_of_trees


def test_processed_probs_filters() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 5.0]])
    allowed = torch.tensor([[True, True, True, True, True, False]])
    one = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    probs = reference.processed_probs(
        logits, allowed, one(1.0), one(2, torch.long), one(1.0), one(0.0)
    )
    e = torch.tensor([4.0, 3.0]).exp()
    assert torch.allclose(probs[0, :2], e / e.sum()) and probs[0, 2:].sum() == 0
    probs = reference.processed_probs(
        logits, allowed, one(1.0), one(0, torch.long), one(0.5), one(0.0)
    )
    assert probs[0].nonzero().flatten().tolist() == [0]  # p0 = 0.64 already reaches 0.5
    probs = reference.processed_probs(
        logits, allowed, one(1.0), one(0, torch.long), one(0.7), one(0.0)
    )
    assert probs[0].nonzero().flatten().tolist() == [0, 1]
    probs = reference.processed_probs(
        logits, allowed, one(1.0), one(0, torch.long), one(1.0), one(0.3)
    )
    assert probs[0].nonzero().flatten().tolist() == [0, 1]  # e^-1 = 0.37 >= 0.3 > e^-2
    probs = reference.processed_probs(
        logits, allowed, one(0.0), one(0, torch.long), one(1.0), one(0.0)
    )
    assert probs[0].tolist() == [1.0, 0, 0, 0, 0, 0]  # greedy ignores the disallowed 5.0


def test_all_disallowed_rows_give_minus_one_not_nan() -> None:
    logits = torch.randn(3, 10)
    mask = torch.tensor([[0], [4], [0]], dtype=torch.int32)  # only row 1 allows token 2
    for temperature in (0.0, 1.0):
        params = SamplingTensors.build(3, temperature=temperature, top_p=0.9)
        out = sample(logits, params, torch.Generator().manual_seed(0), bitmask=mask)
        assert out.tolist() == [-1, 2, -1]
    # unconstrained rows mixed in
    out = sample(logits, SamplingTensors.build(3), bitmask=mask, mask_rows=torch.tensor([0, -1, 1]))
    assert out[0] == -1 and 0 <= out[1] < 10 and out[2] == 2


def test_per_request_seeds_are_reproducible_across_batches() -> None:
    logits = torch.randn(4, 50)
    params = SamplingTensors.build(4, temperature=1.3, top_k=30, min_p=0.01)
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    full = sample(logits, params, gens([1, 2, 3, 4]))
    again = sample(logits, params, gens([1, 2, 3, 4]))
    alone = sample(
        logits[2:3], SamplingTensors.build(1, temperature=1.3, top_k=30, min_p=0.01), gens([3])
    )
    assert torch.equal(full, again) and alone.item() == full[2].item()
    assert sample(logits[:0], params.take(torch.arange(0)), []).numel() == 0


def test_sample_from_probs_never_picks_zero_mass() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(1000, 5)
    u = torch.linspace(0, 1 - 1e-12, 1000, dtype=torch.float64)
    out = reference.sample_from_probs(probs, u)
    assert set(out.tolist()) == {1, 3}


@pytest.mark.parametrize("deterministic_drafts", [True, False])
def test_tree_sampler_matches_scalar_oracle(deterministic_drafts: bool) -> None:
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    vocab = 9
    for _ in range(15):
        sizes = [rng.randint(1, 12) for _ in range(rng.randint(1, 5))]
        fc, ns, tok, offsets = batch_of_trees(rng, sizes, vocab)
        n = offsets[-1]
        logits = torch.randn(n, vocab, generator=gen) * 2
        mask = torch.randint(0, 2**vocab, (n, 1), generator=gen).to(torch.int32)
        valid = torch.rand(n, generator=gen) < 0.9
        drafts = None if deterministic_drafts else torch.rand(n, vocab, generator=gen).softmax(-1)
        params = SamplingTensors.build(len(sizes), temperature=0.9, top_k=7, top_p=0.95)
        out = tree_speculative_sample(
            logits, fc, ns, tok, offsets, params, torch.Generator().manual_seed(3),
            draft_probs=drafts, bitmask=mask, valid=valid,
        )  # fmt: skip
        request = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        node_params = params.take(request)
        allowed = reference.node_allowed(vocab, n, mask, None, vocab, logits.device)
        target = reference.processed_probs(
            logits, allowed, node_params.temperature, node_params.top_k, node_params.top_p,
            node_params.min_p,
        ).double()  # fmt: skip
        u = torch.rand(
            len(sizes),
            max(sizes) + 1,
            generator=torch.Generator().manual_seed(3),
            dtype=torch.float64,
        )
        paths, bonus = reference.tree_sample_oracle(
            target, None if drafts is None else drafts.double(), valid.tolist(), fc.tolist(),
            ns.tolist(), tok.tolist(), offsets, u,
        )  # fmt: skip
        assert out.bonus_token.tolist() == bonus
        assert out.accept_length.tolist() == [len(p) - 1 for p in paths]
        for b, p in enumerate(paths):
            assert out.path[b, : len(p)].tolist() == p


# Target of the statistical test: next-token tables over a 10-token vocabulary that depend on the
# previous token, so the node rows of a tree differ by path.
VOCAB = 10
TREE = [-1, 0, 0, 0, 1, 1, 2]  # parent of each node: root, 3 children, 2 + 1 grandchildren


def _stat_setup(draws: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(11)
    first = torch.randn(VOCAB, generator=gen) * 1.5
    second = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5  # row = previous token
    mask_first = torch.tensor([0b1110111011], dtype=torch.int32)
    q_root = torch.rand(VOCAB, generator=gen).softmax(-1)
    q_second = torch.rand(VOCAB, VOCAB, generator=gen).softmax(-1)
    n = len(TREE)
    # draft tokens: siblings drawn without replacement from the parent's draft distribution
    tokens = torch.zeros(draws, n, dtype=torch.long)
    draft = torch.zeros(draws, n, VOCAB, dtype=torch.float64)
    for parent in range(n):
        kids = [i for i in range(n) if TREE[i] == parent]
        base = (
            q_root.double().expand(draws, VOCAB)
            if parent == 0
            else q_second.double()[tokens[:, parent]]
        ).clone()
        for kid in kids:
            q = base / base.sum(-1, keepdim=True)
            tokens[:, kid] = torch.multinomial(q.float(), 1, generator=gen)[:, 0]
            draft[:, kid] = q
            base.scatter_(1, tokens[:, kid : kid + 1], 0.0)
    logits = torch.zeros(draws, n, VOCAB)
    logits[:, 0] = first
    for i in range(1, n):
        logits[:, i] = second[tokens[:, i]]
    fc, ns = [-1] * n, [-1] * n
    for i in range(n - 1, 0, -1):
        ns[i], fc[TREE[i]] = fc[TREE[i]], i
    as_t = lambda xs: torch.tensor(xs).repeat(draws)  # noqa: E731
    mask = torch.full((draws, n, 1), -1, dtype=torch.int32)
    mask[:, 0, 0] = mask_first
    return {
        "logits": logits.view(-1, VOCAB), "fc": as_t(fc), "ns": as_t(ns),
        "tokens": tokens.view(-1), "draft": draft.view(-1, VOCAB), "mask": mask.view(-1, 1),
        "first": first, "second": second, "mask_first": mask_first,
    }  # fmt: skip


def test_tree_sampling_matches_plain_constrained_sampling() -> None:
    """Chi-square at a fixed seed: emitted tokens vs plain constrained sampling from the target.

    60,000 trees; a 2 % (absolute) shift of probability between two tokens gives a chi-square
    statistic in the hundreds here, far over the 1e-3 critical value (checked below), so a
    deviation that size cannot pass.
    """
    draws = 60_000
    s = _stat_setup(draws)
    params = SamplingTensors.build(draws, temperature=0.8, top_k=8, top_p=0.97, min_p=0.01)
    offsets = list(range(0, draws * len(TREE) + 1, len(TREE)))
    out = tree_speculative_sample(
        s["logits"], s["fc"], s["ns"], s["tokens"], offsets,
        params, torch.Generator().manual_seed(5), draft_probs=s["draft"], bitmask=s["mask"],
    )  # fmt: skip
    tokens = s["tokens"].view(draws, len(TREE))
    node1 = out.path[:, 1]
    first_token = torch.where(
        node1 >= 0, tokens.gather(1, node1.clamp_min(0)[:, None])[:, 0], out.bonus_token
    )
    allowed = reference.allowed_from_bitmask(s["mask_first"].view(1, 1), VOCAB)
    one = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731

    def proc(lg: torch.Tensor, al: torch.Tensor) -> torch.Tensor:
        probs = reference.processed_probs(
            lg, al, one(0.8), one(8, torch.long), one(0.97), one(0.01)
        )
        return probs[0].double()

    p_first = proc(s["first"][None], allowed)
    p_first = p_first / p_first.sum()
    counts = torch.bincount(first_token, minlength=VOCAB).double()
    assert counts[p_first == 0].sum() == 0  # never a disallowed or filtered token
    support = p_first > 0
    _, pvalue = chisquare(counts[support], p_first[support] * draws)
    assert pvalue > 1e-3
    shifted = p_first.clone()
    top = torch.argsort(p_first, descending=True)[:2]
    shifted[top[0]] -= 0.02
    shifted[top[1]] += 0.02
    _, power = chisquare(counts[support], shifted[support] / shifted[support].sum() * draws)
    assert power < 1e-6
    # second token, given an accepted first node: plain sampling from the next-token table
    has_two = out.accept_length >= 1
    second_token = torch.where(
        out.accept_length >= 2,
        tokens.gather(1, out.path[:, 2].clamp_min(0)[:, None])[:, 0],
        out.bonus_token,
    )[has_two]
    prev = first_token[has_two]
    everything = torch.ones(1, VOCAB, dtype=torch.bool)
    table = torch.stack([proc(s["second"][t][None], everything) for t in range(VOCAB)])
    observed = torch.bincount(prev * VOCAB + second_token, minlength=VOCAB * VOCAB).double()
    expected = (torch.bincount(prev, minlength=VOCAB).double()[:, None] * table).flatten()
    assert observed[expected == 0].sum() == 0
    cells = expected > 5
    observed, expected = observed[cells], expected[cells]
    _, pvalue = chisquare(observed, expected * observed.sum() / expected.sum())
    assert pvalue > 1e-3


def test_a_requests_draws_do_not_depend_on_the_other_trees() -> None:
    """With one generator per request, request 0 draws only what its own tree needs: its path
    and bonus are the same alone and next to a larger tree (they moved with the batch's
    largest tree before), and a root-only tree draws one number, as ``sample`` does."""
    rng = random.Random(4)
    vocab = 16
    gen = torch.Generator().manual_seed(8)
    for sizes in ([3], [1]):
        together = [*sizes, 11]
        fc, ns, tok, offsets = batch_of_trees(rng, together, vocab)
        logits = torch.randn(offsets[-1], vocab, generator=gen)
        params = SamplingTensors.build(2, temperature=0.9)
        both = tree_speculative_sample(
            logits, fc, ns, tok, offsets, params,
            [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)],
        )  # fmt: skip
        n = sizes[0]
        alone = SamplingTensors.build(1, temperature=0.9)
        one = tree_speculative_sample(
            logits[:n], fc[:n], ns[:n], tok[:n], offsets[:2], alone,
            [torch.Generator().manual_seed(1)],
        )  # fmt: skip
        assert both.bonus_token[0] == one.bonus_token[0]
        assert both.accept_length[0] == one.accept_length[0]
        assert both.path[0, :n].tolist() == one.path[0, :n].tolist()
    stream = torch.Generator().manual_seed(1)
    torch.rand(1, generator=stream, dtype=torch.float64)  # a root-only tree's one draw
    after = torch.Generator().manual_seed(1)
    tree_speculative_sample(
        logits[:1], fc[:1], ns[:1], tok[:1], [0, 1], SamplingTensors.build(1, temperature=0.9),
        [after],
    )  # fmt: skip
    assert torch.equal(torch.rand(4, generator=after), torch.rand(4, generator=stream))
