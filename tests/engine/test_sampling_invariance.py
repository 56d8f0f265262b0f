"""A seeded request's sampled tokens depend on (prompt, parameters, seed) only.

Logits differ in their last bits with the batch (a CPU GEMM sums in an order that depends on
how many rows share it, prefix-cache hits read K/V computed in another batch). The sampler
certifies each draw against such differences and the step redraws the rest from canonical
logits (the sequence alone from position 0): the same request alone, in a batch of others and
after a prefix-cache hit gives the same tokens, at T=0.8 with top-p and top-k.
"""

from __future__ import annotations

import math
import re

import torch

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import (
    ConstraintOptions,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SpeculativeOptions,
)
from espalier.engine.engine import Engine, EngineConfig
from espalier.engine.sampler import RowParams, Sampler, _keep_sorted, make_generator
from espalier.engine.spec.strategy import SpecConfig, install
from tests.fixtures.engine_fixtures import make_engine, run_all, text_of, tokens_of

PROMPT = "the quick brown fox jumps over the lazy dog and"
V = 64


def _seeded(request_id: str, top_p: float, top_k: int) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=16, temperature=0.8, top_p=top_p, top_k=top_k, seed=7),
    )


def _others(n: int) -> list[GenerationRequest]:
    prompts = ["a", "some longer prompt here", "x y z", PROMPT[:20], "lorem ipsum dolor sit"]
    return [
        GenerationRequest(
            f"other-{i}",
            prompt=prompts[i % len(prompts)] * (1 + i % 3),
            sampling=SamplingParams(max_tokens=5 + 3 * i, temperature=1.0, seed=100 + i),
        )
        for i in range(n)
    ]


def _engine(margin: float | None = None) -> Engine:
    engine = make_engine()
    if margin is None:
        return engine
    # the same runner and scheduler limits with another certification lead
    engine.close()
    config = EngineConfig(scheduler=engine.config.scheduler, sampling_margin=margin)
    return Engine(config, engine.runner, engine.tokenizer)


def _three_ways(
    engine: Engine, top_p: float, top_k: int = 0
) -> tuple[list[int], list[int], list[int]]:
    """The seeded request alone, in a batch of 7 others, and again alone on a prefix hit."""
    alone = tokens_of(run_all(engine, [_seeded("alone", top_p, top_k)])["alone"])
    batch = run_all(engine, [*_others(4), _seeded("batched", top_p, top_k), *_others(7)[4:]])
    before = engine.scheduler.prefix_hit_tokens
    cached = run_all(engine, [_seeded("cached", top_p, top_k)])["cached"]
    assert engine.scheduler.prefix_hit_tokens > before  # really read from the prefix cache
    return alone, tokens_of(batch["batched"]), tokens_of(cached)


def test_seeded_request_alone_batched_and_cached_agree() -> None:
    for top_p, top_k in ((0.9, 0), (0.7, 20)):
        alone, batched, cached = _three_ways(_engine(), top_p, top_k)
        assert len(alone) == 16 and len(set(alone)) > 3  # really sampling
        assert batched == alone
        assert cached == alone


def test_canonical_redraws_give_the_certified_draws() -> None:
    """With a lead no draw reaches, every sampled token is redrawn from canonical logits: the
    tokens are those of the certified batch draws, alone, batched and cached alike."""
    always = _engine(margin=math.inf)
    alone, batched, cached = _three_ways(always, 0.9)
    assert always.strategy.num_canonical_redraws >= 3 * 16  # type: ignore[attr-defined]
    assert batched == alone == cached
    assert alone == _three_ways(_engine(), 0.9)[0]


def test_canonical_redraws_keep_constrained_rows_in_their_grammar() -> None:
    """Constrained rows are redrawn from masked canonical logits, sparse-head rows (few allowed
    tokens: their batch logits never had a mask applied) included."""
    always = _engine(margin=math.inf)
    specs = {
        "choice": (GrammarSpec.choice(["alpha", "beta", "gamma"]), "alpha|beta|gamma"),
        "regex": (GrammarSpec.regex("[a-z]{3,10}"), "[a-z]{3,10}"),
    }
    requests = [
        GenerationRequest(
            name,
            prompt=PROMPT,
            sampling=SamplingParams(max_tokens=12, temperature=0.8, seed=5 + i),
            grammar=spec,
            constraint=ConstraintOptions(backend="llguidance"),
        )
        for i, (name, (spec, _)) in enumerate(specs.items())
    ]
    chunks = run_all(always, requests)
    for name, (_, pattern) in specs.items():
        assert chunks[name][-1].finish_reason is not FinishReason.ERROR, chunks[name][-1]
        assert re.fullmatch(pattern, text_of(chunks[name])), text_of(chunks[name])
    assert always.strategy.num_canonical_redraws >= 2  # type: ignore[attr-defined]


def test_near_tie_is_uncertain_and_redrawn_canonically() -> None:
    """Two batch versions of one row, 2e-6 apart, that the race splits between two tokens: both
    are reported uncertain, and the redraw from the canonical logits settles them alike."""
    noise = torch.empty(V).exponential_(generator=make_generator(3)).log_().neg_()
    canonical = torch.full((V,), -4.0)
    a, b = 10, 11
    canonical[a] = 2.0 - float(noise[a]) * 0.8
    canonical[b] = 2.0 - float(noise[b]) * 0.8 + 1e-6  # b leads a by ~1e-6 / 0.8 in the race
    p = RowParams(temperature=0.8, top_p=0.95)
    drawn = set()
    for shift in (+2e-6, -2e-6):
        batch = canonical.clone()
        batch[a] += shift
        row = RowParams(p.temperature, top_p=p.top_p, generator=make_generator(3))
        out = Sampler()(batch.unsqueeze(0), [row])
        assert 0 in out.uncertain
        assert torch.equal(out.uncertain[0], noise)
        drawn.add(out.token_ids[0])
        assert Sampler.redraw(canonical, p, out.uncertain[0]) == b
    assert drawn == {a, b}  # the batch draw alone would differ


def test_clear_winners_are_certified() -> None:
    gen = make_generator(5)
    logits = torch.randn(6, V, generator=gen) * 3
    params = [RowParams(temperature=0.8, top_p=0.9, generator=make_generator(i)) for i in range(6)]
    certain = Sampler(margin=1e-9)(logits.clone(), params)
    assert certain.uncertain == {}
    # the same draws with the default lead (uncertain rows may be reported, tokens unchanged)
    params = [RowParams(temperature=0.8, top_p=0.9, generator=make_generator(i)) for i in range(6)]
    assert Sampler()(logits.clone(), params).token_ids == certain.token_ids


def test_top_p_boundary_contender_is_uncertain() -> None:
    """A token whose mass-before sits on p: the narrowed filter drops it, so if it wins the race
    the draw is uncertain."""
    probs = torch.tensor([0.5, 0.4, 0.1] + [0.0] * (V - 3))
    logits = probs.clamp_min(1e-30).log()
    # p = 0.9: token 2's mass before is 0.9 (dropped at >= p); at 0.9 - 1e-4 / 0.9 + 1e-4 it
    # flips. Find a seed whose race the boundary token would win if kept.
    for seed in range(200):
        noise = torch.empty(V).exponential_(generator=make_generator(seed)).log_().neg_()
        scores = logits + noise
        if int(scores[:3].argmax()) == 2:
            break
    else:
        raise AssertionError("no seed where token 2 wins")
    params = RowParams(temperature=1.0, top_p=0.9 + 5e-4, generator=make_generator(seed))
    out = Sampler()(logits.unsqueeze(0).clone(), [params])
    assert out.token_ids[0] == 2 and 0 in out.uncertain


def test_widened_and_narrowed_filters_bracket_the_nominal_ones() -> None:
    """For random rows and filter settings: the keep masks at slacks (0, +m, -m) computed
    together equal each computed alone, and widened ⊇ nominal ⊇ narrowed."""
    rng = torch.Generator().manual_seed(11)
    for trial in range(30):
        batch = 1 + trial % 4
        logits = torch.randn(batch, V, generator=rng) * 2
        logits[:, :3] = float("-inf")  # grammar-masked ids
        params = [
            RowParams(
                temperature=0.8,
                top_k=int(torch.randint(0, 12, (1,), generator=rng)) * (trial % 2),
                top_p=[1.0, 0.9, 0.5][(trial + i) % 3],
                min_p=[0.0, 0.05][(trial // 2 + i) % 2],
            )
            for i in range(batch)
        ]
        values = (logits / 0.8).sort(dim=-1, descending=True).values
        margin = 0.05
        together = _keep_sorted(values, params, [0.0, margin, -margin])
        alone = [_keep_sorted(values, params, [s])[0] for s in (0.0, margin, -margin)]
        for a, b in zip(together, alone):
            assert torch.equal(a, b)
        nominal, widened, narrowed = together
        assert bool((nominal <= widened).all()) and bool((narrowed <= nominal).all())
        assert bool(nominal[:, 0].all())  # the most likely token always stays


def test_requests_that_do_not_speculate_sample_as_on_a_plain_engine() -> None:
    """With speculation loaded but not asked for, steps run on the plain strategy: the same
    certified draws as an engine without speculation, alone and batched."""
    plain_alone, plain_batched, _ = _three_ways(_engine(), 0.9)
    spec = install(make_engine(), SpecConfig(enabled=False, methods=("forced",)), {})
    spec_alone, spec_batched, spec_cached = _three_ways(spec, 0.9)
    assert spec_alone == plain_alone and spec_batched == plain_batched == plain_alone
    assert spec_cached == plain_alone


def _speculating(request_id: str, enabled: bool, seed: int = 7) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=seed),
        speculative=SpeculativeOptions(enabled=enabled),
    )


def _companion(request_id: str) -> GenerationRequest:
    """A sampled constrained request that speculates (trees of forced chains)."""
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Lima"]}, "ok": {"type": "boolean"}},
        "required": ["city", "ok"],
        "additionalProperties": False,
    }
    return GenerationRequest(
        request_id,
        prompt="x y z",
        sampling=SamplingParams(max_tokens=17, temperature=0.9, seed=12),
        grammar=GrammarSpec.json_schema(schema),
        speculative=SpeculativeOptions(enabled=True),
    )


def test_seeded_requests_keep_their_tokens_next_to_speculating_ones() -> None:
    """A seeded request that does not speculate draws as in a plain step (root-only trees are
    drawn by the plain sampler), and one that does draws only as many numbers as its own tree
    needs: before, both moved with what shared their steps."""

    def spec() -> Engine:  # a fresh one per run: no prefix-cache hit between them
        return install(make_engine(), SpecConfig(enabled=True, methods=("forced", "ngram")), {})

    plain = tokens_of(run_all(_engine(), [_seeded("plain", 0.9, 0)])["plain"])
    for enabled in (False, True):
        alone = tokens_of(run_all(spec(), [_speculating("alone", enabled)])["alone"])
        both = run_all(spec(), [_speculating("with", enabled), _companion("companion")])
        assert len(set(alone)) > 3  # really sampling
        assert tokens_of(both["with"]) == alone, enabled
        if not enabled:
            assert alone == plain[:12]


def test_a_root_only_tree_is_drawn_by_the_plain_sampler() -> None:
    """In a speculative step, a sampled request with a root-only tree (one that does not
    speculate) gets the plain sampler's token from its root's logits and its generator, next to
    a request with a larger tree; the tree sampler drew another (its own noise)."""
    from espalier.engine.spec.combine import Proposer
    from espalier.engine.spec.decoder import SamplingSpec, SpecSeq, SpeculativeDecoder
    from espalier.engine.spec.masks import MaskBuilder
    from espalier.engine.spec.tree_builder import Draft, NodeSource
    from espalier.engine.spec.verify import TreeMasks

    runner = make_engine().runner
    decoder = SpeculativeDecoder(runner, Proposer({}), MaskBuilder(runner.vocab_size))
    tree = Draft(
        [3, 4, 5, 6], [-1, 0, 0, 1], [0.0] * 4, [NodeSource.ROOT] + [NodeSource.FORCED] * 3
    )
    drafts = [Draft.root_only(3), tree]
    nodes = sum(d.num_nodes for d in drafts)
    masks = TreeMasks(
        None, torch.full((nodes,), -1), torch.ones(nodes, dtype=torch.bool),
        torch.ones(nodes, dtype=torch.bool),
    )  # fmt: skip
    for seed in range(8):
        logits = torch.randn(nodes, runner.vocab_size, generator=make_generator(100 + seed))
        seqs = [
            SpecSeq(
                f"r{i}",
                [1, 2, 3],
                [0],
                sampling=SamplingSpec(0.8, 0, 0.9, 0.0, make_generator(seed + 10 * i)),
            )
            for i in range(2)
        ]
        got = decoder._verify(logits.clone(), seqs, drafts, masks)[0]
        row = RowParams(0.8, 0, 0.9, 0.0, make_generator(seed))
        want = Sampler()(logits[:1].clone(), [row]).token_ids[0]
        assert got.tokens == [want] and got.path == [0], seed
