"""The fast GPU path against the plain one: flashinfer vs torch SDPA, CUDA-graph replay vs eager.

Logits agree within bf16 tolerance for prefill, decode and draft-tree steps (full and
sliding-window layers, Llama and Gemma 3); greedy outputs of eager steps and graph replays are
identical token for token, for plain and speculative decoding, with and without a grammar; across
kernels (SDPA, flashinfer, the small-query kernel; tree rows against decode rows) they may part
only at a bf16 near-tie; greedy ties break the same way (lowest id) in the plain sampler and in
tree verification.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from espalier.engine.config import ModelOptions
from espalier.engine.model.runner import SeqInput
from espalier.engine.spec.combine import Proposer
from espalier.engine.spec.decoder import SpeculativeDecoder
from espalier.engine.spec.masks import MaskBuilder
from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
from espalier.engine.spec.tree_builder import tree_attention_mask
from tests.fixtures.gpu_models import depths, gpu_config, gpu_runner, gpu_state, tree_input
from tests.fixtures.spec_helpers import compile_matcher
from tests.fixtures.spec_loop import LoopRequest, SpecLoop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

#   tree of the verify step (node: parent)      0
#                                             / | \
#                                            1  2  3
#                                           / \     \
#                                          4   5     6
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 3]


def step_logits(runner: Any) -> list[torch.Tensor]:
    """Prefill two prompts, decode both, then verify a tree for one while the other decodes."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (19, 7)]
    tables = [list(range(0, 16)), list(range(16, 32))]
    out = [runner.forward([SeqInput(t, p, 0) for t, p in zip(tables, prompts)]).logits]
    out.append(runner.forward([SeqInput(t, [5], len(p)) for t, p in zip(tables, prompts)]).logits)
    ctx = [len(p) + 1 for p in prompts]
    tree_tokens = torch.randint(0, 90, (len(TREE_PARENTS),), generator=gen).tolist()
    tree = SeqInput(
        tables[0],
        tree_tokens,
        ctx[0],
        positions=[ctx[0] + d for d in depths(TREE_PARENTS)],
        custom_mask=tree_attention_mask(TREE_PARENTS, ctx[0]),
        logits="all",
    )
    out.append(runner.forward([tree, SeqInput(tables[1], [9], ctx[1])]).logits)
    return out


@pytest.mark.parametrize(
    ("family", "window"), [("llama", None), ("llama", 6), ("gemma3", 6), ("gemma3", None)]
)
def test_flashinfer_logits_match_sdpa(family: str, window: int | None) -> None:
    config = gpu_config(97, family=family, window=window)
    state = gpu_state(config, seed=0)
    sdpa = step_logits(gpu_runner(config, state, backend="sdpa"))
    fast = gpu_runner(config, state, backend="flashinfer")
    assert fast.attention.name == "flashinfer"
    for want, got in zip(sdpa, step_logits(fast)):
        assert want.shape == got.shape
        scale = want.abs().max()
        assert (want - got).abs().max() <= 0.03 * scale, (want - got).abs().max() / scale


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_kernel_matches_the_prefill_kernel(family: str) -> None:
    """One-token causal steps run flashinfer's decode kernel (sliding-window layers too), with
    the logits of its prefill kernel; tree steps keep the prefill kernel."""
    config = gpu_config(97, family=family, window=6)
    state = gpu_state(config, seed=3)
    flashinfer_only = ModelOptions(small_query_up_to=0, decode_kernel_up_to=0)
    prefill = gpu_runner(config, state, backend="flashinfer", options=flashinfer_only)
    want = step_logits(prefill)
    assert not prefill.attention._eager_decode
    # the decode step has 2 sequences
    with_decode = ModelOptions(small_query_up_to=0, decode_kernel_up_to=2)
    decode = gpu_runner(config, state, backend="flashinfer", options=with_decode)
    got = step_logits(decode)
    assert decode.attention._eager_decode  # the decode step was planned on decode wrappers
    for a, b in zip(want, got):
        assert a.shape == b.shape
        scale = a.abs().max()
        assert (a - b).abs().max() <= 0.02 * scale, (a - b).abs().max() / scale


@pytest.mark.parametrize("small", [True, False])
def test_graph_replay_matches_eager_logits(small: bool) -> None:
    """Padded replay (3, then 2 sequences in the buckets of 4 and 2) gives the eager logits;
    decode graphs attend with the small-query kernel or (``small`` False) with flashinfer: up to
    ``decode_kernel_up_to`` sequences its decode kernel, bigger ones its prefill kernel (both
    kinds here, around a limit of 2); with plans made ahead (during the previous replay, into
    the bucket's second graph), and a plan made ahead for a step that does not come (a sequence
    left) left unused."""
    import flashinfer

    from espalier.engine.model.attention import small_query

    options = ModelOptions(small_query_up_to=16 if small else 0, decode_kernel_up_to=2)
    config = gpu_config(97, window=6)
    state = gpu_state(config, seed=2)
    eager = gpu_runner(config, state, backend="flashinfer", options=options)
    graphs = gpu_runner(config, state, backend="flashinfer", graphs=(1, 2, 4), options=options)
    assert graphs.graphs is not None and graphs.graphs.captured == [(1, 1), (2, 1), (4, 1)]
    assert graphs.num_blocks == eager.num_blocks  # the scratch block is extra
    kinds = {b: type(graphs.graphs.graphs[(b, 1)].wrappers.wrappers[None]) for b in (2, 4)}
    if small:
        assert kinds[2] is kinds[4] is small_query.SmallQueryWrapper
    else:
        assert kinds[2] is flashinfer.BatchDecodeWithPagedKVCacheWrapper
        assert kinds[4] is flashinfer.BatchPrefillWithPagedKVCacheWrapper
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34]]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    for runner in (eager, graphs):
        runner.forward([SeqInput(t, p, 0, logits="none") for t, p in zip(tables, prompts)])
    for step in range(12):
        live = [0, 1, 2] if step < 6 else [0, 2]  # the second sequence leaves at step 6
        batch = [SeqInput(tables[i], [40 + step], len(prompts[i]) + step) for i in live]
        want, got = eager.forward(batch).logits, graphs.forward(batch).logits
        assert torch.allclose(want, got, atol=0.02 * float(want.abs().max()), rtol=0), step
    assert graphs.graphs.replays == {1: 12}
    # ahead: every step but the first of each batch (and the spare graphs exist)
    assert graphs.graphs.planned_ahead == 10
    assert sorted(graphs.graphs.spares) == [1, 2, 4]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pdl_replay_gives_the_logits_of_plain_stream_order(family: str) -> None:
    """Decode graphs (batch 1 and a padded 3) and tree-verify graphs captured with programmatic
    dependent launch (``kernels/pdl.py``) give, bit for bit, the logits of graphs captured
    without it: the same kernels, so any difference is a kernel reading before the previous
    one finished. PDL at every step size (``KernelOptions.pdl_max_rows``: by default steps of
    one token only; here the batch-4 and tree graphs too), and every projection on the path it
    takes without PDL (``gate_up_m1_under_pdl`` off), so that the kernels are the same."""
    from espalier.kernels.options import KernelOptions

    config = gpu_config(97, family=family, window=6)
    state = gpu_state(config, seed=3)
    runners = []
    for on in (False, True):
        kernels = KernelOptions(pdl=on, pdl_max_rows=1 << 30, gate_up_m1_under_pdl=False)
        runners.append(
            gpu_runner(
                config,
                state,
                backend="flashinfer",
                graphs=(1, 4),
                trees=(7,),
                block_size=8,
                options=ModelOptions(kernels=kernels),
            )
        )
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34]]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    outs: list[list[torch.Tensor]] = [[], []]
    for runner, out in zip(runners, outs):
        runner.forward([SeqInput(t, p, 0, logits="none") for t, p in zip(tables, prompts)])
        ctx = [len(p) for p in prompts]
        for step in range(6):
            live = [0] if step % 2 else [0, 1, 2]
            batch = [SeqInput(tables[i], [40 + step], ctx[i]) for i in live]
            out.append(runner.forward(batch).logits)
            ctx = [c + (i in live) for i, c in enumerate(ctx)]
        tree = SeqInput(
            tables[0],
            [50 + i for i in range(len(TREE_PARENTS))],
            ctx[0],
            positions=[ctx[0] + d for d in depths(TREE_PARENTS)],
            custom_mask=tree_attention_mask(TREE_PARENTS, ctx[0]),
            logits="all",
        )
        out.append(runner.forward([tree]).logits)
    for runner in runners:
        assert runner.graphs is not None and runner.graphs.replays == {1: 6, 7: 1}
    for step, (want, got) in enumerate(zip(*outs)):
        assert torch.equal(want, got), step


def test_tree_verify_graph_matches_eager_logits() -> None:
    """Three sequences verifying 7-node trees (bucket 4, padded; sliding-window layer too)."""
    config = gpu_config(97, window=6)
    state = gpu_state(config, seed=5)
    eager = gpu_runner(config, state, backend="flashinfer", block_size=8)
    graphs = gpu_runner(
        config, state, backend="flashinfer", graphs=(1, 2, 4), trees=(7,), block_size=8
    )
    assert graphs.graphs is not None and (4, 7) in graphs.graphs.captured
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34]]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    for runner in (eager, graphs):
        runner.forward([SeqInput(t, p, 0, logits="none") for t, p in zip(tables, prompts)])
    ctx = [len(p) for p in prompts]
    for step in range(4):
        batch = [tree_input(t, c, TREE_PARENTS, 50 + step) for t, c in zip(tables, ctx)]
        assert graphs.replays(batch) and not eager.replays(batch)
        larger = SeqInput(
            tables[2],
            list(range(8)),
            ctx[2],
            custom_mask=tree_attention_mask(list(range(-1, 7)), ctx[2]),
            logits="all",
        )
        assert not graphs.replays(batch[:2] + [larger])  # 8 nodes: no captured size holds it
        want, got = eager.forward(batch), graphs.forward(batch)
        assert got.logits_indptr == want.logits_indptr == [0, 7, 14, 21]
        scale = float(want.logits.abs().max())
        assert torch.allclose(want.logits, got.logits, atol=0.02 * scale, rtol=0), step
        ctx = [c + 3 for c in ctx]  # as if 2 nodes + a bonus were accepted
    assert graphs.graphs.replays == {7: 4}


@pytest.mark.parametrize("small_query_up_to", [16, 0])
def test_padded_tree_verify_graph_matches_eager_logits(small_query_up_to: int) -> None:
    """Trees of 9, 3 and 1 nodes and a plain decode in one step replay the 9-node graph, padded
    (``engine/model/graph_padding.py``), on espalier's small-query kernel and on flashinfer's: the
    logits of the eager step, and the same K/V outside the scratch block."""
    options = ModelOptions(small_query_up_to=small_query_up_to)
    config = gpu_config(97, window=6)
    state = gpu_state(config, seed=6)
    geometry = {"block_size": 16, "num_blocks": 64, "options": options}
    eager = gpu_runner(config, state, backend="flashinfer", **geometry)
    graphs = gpu_runner(config, state, backend="flashinfer", graphs=(4, 8), trees=(9,), **geometry)
    assert graphs.graphs is not None and (8, 9) in graphs.graphs.captured
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34], [40] * 12, [41] * 3]
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(len(prompts))]
    for runner in (eager, graphs):
        runner.forward([SeqInput(t, p, 0, logits="none") for t, p in zip(tables, prompts)])
    ctx = [len(p) for p in prompts]
    shapes = [[-1, 0, 0, 0, 1, 1, 3, 4, 6], [-1, 0, 1], [-1], [-1, 0]]
    for step in range(3):
        batch = [tree_input(t, c, p, 50 + step) for t, c, p in zip(tables, ctx, shapes)]
        batch.append(SeqInput(tables[4], [60 + step], ctx[4]))  # a plain decode
        assert graphs.replays(batch) and not eager.replays(batch)
        want, got = eager.forward(batch), graphs.forward(batch)
        assert got.logits_indptr == want.logits_indptr == [0, 9, 12, 13, 15, 16]
        scale = float(want.logits.abs().max())
        assert torch.allclose(want.logits, got.logits, atol=0.02 * scale, rtol=0), step
        scratch = graphs.graphs.scratch_block
        for layer in range(config.num_layers):
            for a, b in (
                (eager.kv_cache.k, graphs.kv_cache.k),
                (eager.kv_cache.v, graphs.kv_cache.v),
            ):
                diff = (a[layer][:scratch].float() - b[layer][:scratch].float()).abs().max()
                assert float(diff) <= 0.02 * max(float(a[layer].abs().max()), 1e-3), (step, layer)
        ctx = [c + k for c, k in zip(ctx, (3, 2, 1, 2, 1))]
    assert graphs.graphs.replays == {9: 3} and graphs.graphs.padded_replays == {9: 3}


def make_loop(runner: Any) -> SpecLoop:
    proposer = Proposer({"ngram": NgramDrafter(NgramConfig(min_n=1, max_n=3))})
    return SpecLoop(SpeculativeDecoder(runner, proposer, MaskBuilder(runner.vocab_size)))


SETUPS = [  # prompt, grammar backend, drafters
    ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], "llguidance", ("ngram", "forced")),
    ([40, 41, 42, 43, 44, 45, 40, 41, 42], None, ("ngram",)),
    ([99, 100, 101], "xgrammar", ("forced",)),
    ([7, 7, 7, 7], None, ("ngram",)),
]


def loop_outputs(runner: Any, tokenizer: Any, speculate: bool) -> list[list[int]]:
    """Greedy outputs of a mixed batch: constrained (two backends) and free requests."""
    stops = frozenset(tokenizer.stop_token_ids)
    draft = 6 if speculate else 0
    setups = SETUPS
    requests = [
        LoopRequest(
            f"r{i}",
            prompt,
            28,
            compile_matcher(tokenizer, backend) if backend else None,
            methods,
            draft,
            stops,
        )
        for i, (prompt, backend, methods) in enumerate(setups)
    ]
    return [r.output_ids for r in make_loop(runner).generate(requests)]


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers around ``x`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def diverges_at_a_near_tie(runner: Any, prompt: list[int], want: list[int], got: list[int]) -> str:
    """'' when ``got == want``; else why the first token where they differ is not a near-tie:
    there, the reference ``runner``'s logits (teacher-forced on the common prefix) of the two
    tokens must lie within 2 bf16 spacings of each other (one rounding of a logit or of the
    attention in between can flip such a pair; a real fault moves logits further)."""
    if got == want:
        return ""
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    if i == min(len(want), len(got)):
        return f"one output is a prefix of the other ({len(want)} vs {len(got)} tokens)"
    table = list(range(64))
    logits = runner.forward([SeqInput(table, prompt + want[:i], 0)]).logits[0].float()
    a, b = float(logits[want[i]]), float(logits[got[i]])
    if abs(a - b) <= 2 * bf16_ulp(max(abs(a), abs(b))):
        return ""
    return f"token {i}: {want[i]} ({a}) vs {got[i]} ({b}) is no near-tie"


def test_greedy_outputs_identical_across_paths(toy_tokenizer: Any) -> None:
    """SDPA eager, flashinfer eager, flashinfer + graphs: plain and speculative, with and without
    grammars: the same tokens where the kernels are the same (flashinfer eager and graphs,
    token for token), and across kernels up to bf16 near-ties (SDPA against flashinfer's paths,
    speculative against plain: tree rows and decode rows round differently; seed 4's second
    prompt has its first two logits 13.125 / 13.0 under SDPA, which the small-query kernel's
    rounding ties; ``diverges_at_a_near_tie``)."""
    config = gpu_config(toy_tokenizer.vocab_size, window=8)
    state = gpu_state(config, seed=4)
    runners = {
        "sdpa": gpu_runner(config, state, backend="sdpa"),
        "flashinfer": gpu_runner(config, state, backend="flashinfer"),
        "graphs": gpu_runner(config, state, backend="flashinfer", graphs=(1, 2, 4, 8), trees=(4,)),
    }
    results = {
        (name, spec): loop_outputs(runner, toy_tokenizer, spec)
        for name, runner in runners.items()
        for spec in (False, True)
    }
    reference = results[("sdpa", False)]
    assert any(len(out) > 5 for out in reference)
    for spec in (False, True):
        assert results[("graphs", spec)] == results[("flashinfer", spec)], spec
    for key, outputs in results.items():
        for (prompt, _, _), want, got in zip(SETUPS, reference, outputs):
            assert not (why := diverges_at_a_near_tie(runners["sdpa"], prompt, want, got)), (
                key,
                why,
            )
    assert runners["graphs"].graphs is not None
    assert sum(runners["graphs"].graphs.replays.values()) > 0


def test_greedy_ties_break_to_the_lowest_id() -> None:
    """bf16 logits tie often: the plain sampler and the verify kernel both pick the lowest id."""
    from espalier.engine.sampler import RowParams, Sampler
    from espalier.engine.spec.tree_builder import Draft
    from espalier.engine.spec.verify import verify_greedy

    logits = torch.zeros((2, 4096), device="cuda")
    logits[0, [17, 900, 3000]] = 2.5  # a three-way tie
    logits[1, [4000, 5, 77]] = torch.tensor([1.0, 1.0, 0.5], device="cuda").bfloat16().float()
    plain = Sampler()(logits.clone(), [RowParams(), RowParams()]).token_ids
    assert plain == [17, 5]
    drafts = [Draft.root_only(1), Draft.root_only(2)]
    accepted = verify_greedy(logits, drafts, None, 4096)
    assert [a.tokens for a in accepted] == [[17], [5]]
    assert torch.argmax(logits, dim=-1).tolist() == [17, 5]
