"""Drafter and tree-building units: trie dedupe, reranking closure, encodings, n-gram and
forced-chain drafts, merging, draft-model tree shape, EAGLE checkpoint loading.

A tree used below (tokens in brackets, node ids before them)::

    0:[9]
    ├─1:[4]
    │ ├─2:[5]
    │ └─3:[6]
    └─4:[7]
      └─5:[8]
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from espalier.constrained.batch import BatchFiller
from espalier.constrained.tree import DraftTree
from espalier.engine.spec.base import DraftInput
from espalier.engine.spec.combine import ProposalItem, Proposer
from espalier.engine.spec.forced import ForcedConfig, extend_leaves, root_chain
from espalier.engine.spec.ngram import NgramConfig, NgramDrafter, NgramIndex
from espalier.engine.spec.tree_builder import (
    Draft,
    NodeSource,
    TreeBuilder,
    select_top,
    sibling_links,
    tree_attention_mask,
)
from espalier.engine.spec.verify import compaction_slots
from tests.fixtures.spec_helpers import (  # noqa: F401 (autouse fixture)
    compile_matcher,
    one_thread,
    random_eagle,
    random_runner,
    tiny_config,
)

PARENTS = [-1, 0, 1, 1, 0, 4]
TOKENS = [9, 4, 5, 6, 7, 8]


def test_builder_dedupes_and_keeps_best_score() -> None:
    builder = TreeBuilder(9)
    a = builder.add_path(0, [4, 5], [-1.0, -2.0], NodeSource.NGRAM)
    b = builder.add_path(0, [4, 6], [-0.5, -3.0], NodeSource.MODEL)
    assert a[0] == b[0] and a[1] != b[1]
    assert builder.scores[a[0]] == -0.5  # the better score wins
    assert builder.sources[a[0]] == NodeSource.NGRAM  # the first proposer keeps the node
    draft = builder.build()
    draft.validate()
    assert draft.tokens == [9, 4, 5, 6]


def test_select_top_is_closed_under_ancestors() -> None:
    rng = random.Random(0)
    for _ in range(200):
        builder = TreeBuilder(0)
        for _ in range(rng.randint(1, 40)):
            parent = rng.randrange(builder.num_nodes)
            score = builder.scores[parent] - rng.random() * (rng.random() < 0.8)
            builder.add(parent, rng.randrange(50), score, NodeSource.MODEL)
        draft = builder.build()
        keep = rng.randint(0, draft.num_draft_tokens)
        top = select_top(draft, keep)
        top.validate()
        assert top.num_draft_tokens == min(keep, draft.num_draft_tokens)
        kept_paths = {tuple(top.path_tokens(i)) for i in range(top.num_nodes)}
        for i in range(top.num_nodes):  # every prefix of a kept path is kept
            path = top.path_tokens(i)
            assert all(tuple(path[:d]) in kept_paths for d in range(len(path)))


def test_sibling_links_match_draft_tree_encoding() -> None:
    first_child, next_sibling = sibling_links(PARENTS)
    tree = DraftTree.from_parents(TOKENS, PARENTS)
    assert first_child == tree.first_child.tolist()
    assert next_sibling == tree.next_sibling.tolist()
    assert tree.parents.tolist() == PARENTS


def test_tree_attention_mask_sees_context_ancestors_and_self() -> None:
    mask = tree_attention_mask(PARENTS, context_len=3)
    assert mask.shape == (6, 9)
    assert mask[:, :3].all()
    expected = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 1, 3}, 4: {0, 4}, 5: {0, 4, 5}}
    for node, seen in expected.items():
        assert set(torch.nonzero(mask[node, 3:]).flatten().tolist()) == seen


def test_compaction_moves_accepted_nodes_into_place() -> None:
    # block size 4, table [7, 2, 5]: cache index i -> slot table[i // 4] * 4 + i % 4
    src, dst = compaction_slots([7, 2, 5], 4, context_len=2, path=[0, 4, 5])
    assert src == [2 * 4 + 2, 2 * 4 + 3]  # indices 6, 7
    assert dst == [7 * 4 + 3, 2 * 4 + 0]  # indices 3, 4
    assert compaction_slots([7, 2, 5], 4, 2, [0, 1, 2]) == ([], [])


def test_ngram_index_tracks_extensions_and_resets() -> None:
    index = NgramIndex(1, 2)
    index.sync([1, 2, 1])
    index.sync([1, 2, 1, 2])
    assert index.ends[(1, 2)] == [1, 3]
    index.sync([5, 6])  # not an extension: rebuilt
    assert index.tokens == [5, 6] and (1, 2) not in index.ends


def test_ngram_drafts_the_continuations_of_earlier_matches() -> None:
    drafter = NgramDrafter(NgramConfig(min_n=1, max_n=3, max_matches=4, max_depth=3))
    context = [1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2]
    [draft] = drafter.propose([DraftInput("a", context, (), 16)])
    draft.validate()
    assert draft.tokens[0] == 2
    paths = {tuple(draft.path_tokens(i)) for i in draft.leaves()}
    assert paths == {(3, 5, 1), (3, 4, 9)}  # after "1 2": most recent first
    assert draft.path_tokens(1) == [3]  # both agree on 3: one node, best score
    [small] = drafter.propose([DraftInput("a", context, (), 2)])
    assert small.num_draft_tokens == 2 and small.path_tokens(2) == [3, 5]
    [none] = drafter.propose([DraftInput("b", [1, 2, 3], (), 8)])
    assert none.num_nodes == 1


def test_ngram_drafts_after_a_forced_chain() -> None:
    drafter = NgramDrafter(NgramConfig(min_n=2, max_n=2, max_depth=2))
    [draft] = drafter.propose([DraftInput("a", [1, 2, 3, 4, 1], [2], 8)])
    assert draft.tokens[0] == 2 and draft.path_tokens(draft.num_nodes - 1) == [3, 4]


def _extended(draft: Draft, matcher: Any, budget: int) -> Draft:
    """One draft through :func:`extend_leaves` (the batch call of one request)."""
    [out] = extend_leaves(BatchFiller(1), [draft], [matcher], [budget], ForcedConfig())
    return out


def test_forced_chains_from_a_real_grammar(toy_tokenizer: Any) -> None:
    matcher = compile_matcher(toy_tokenizer, "llguidance")
    chain = root_chain(matcher, 16)
    text = toy_tokenizer.hf.decode(chain)
    assert text.startswith('{"') and chain
    assert root_chain(None, 16) == []
    # a leaf right after the first key's colon: the grammar forces nothing else yet; a leaf
    # inside the forced prefix gets the rest of the chain grafted below it
    builder = TreeBuilder(0)
    builder.add_path(0, chain[:1], [-0.1], NodeSource.MODEL)
    draft = _extended(builder.build(), matcher, 32)
    draft.validate()
    assert draft.path_tokens(draft.num_nodes - 1) == chain
    assert draft.sources[2:] == [NodeSource.FORCED] * (len(chain) - 1)
    assert root_chain(matcher, 16) == chain  # the matcher state is unchanged


def test_leaf_probes_of_a_batch_equal_each_drafts_own(toy_tokenizer: Any) -> None:
    """``extend_leaves`` probes a batch's drafts in rounds (one batch accept of forks a round)
    and gives each draft the chains it gets alone: leaves inside the forced prefix get the
    rest of the chain, a rejected branch none, a tight budget a cut chain (and no room for
    the next leaf), no grammar none; llguidance (forks) and xgrammar (in place) mixed. The
    matchers do not move."""
    llg = [compile_matcher(toy_tokenizer, "llguidance") for _ in range(3)]
    xgr = compile_matcher(toy_tokenizer, "xgrammar")
    chain = root_chain(llg[0], 16)
    assert len(chain) >= 4
    bad = next(t for t in range(toy_tokenizer.vocab_size) if t not in chain)

    def draft(*paths: list[int]) -> Draft:
        builder = TreeBuilder(0)
        for n, path in enumerate(paths):
            builder.add_path(0, path, [-0.1 * (n + 1)] * len(path), NodeSource.MODEL)
        return builder.build()

    drafts = [
        draft(chain[:2], [chain[0], bad]),  # the best leaf extends, the rejected one does not
        draft(chain[:1], [bad]),
        draft(chain[:2], chain[:1] + [bad]),  # budget 5: the chain is cut at 3 nodes
        draft(chain[:2]),  # no grammar
        draft(chain[:2], [chain[0], bad]),  # xgrammar: probed in place
    ]
    matchers: list[Any] = [llg[0], llg[1], llg[2], None, xgr]
    budgets = [32, 32, 5, 32, 32]
    alone = [
        _extended(d, m, b) if m is not None else d for d, m, b in zip(drafts, matchers, budgets)
    ]
    together = extend_leaves(BatchFiller(2), drafts, matchers, budgets, ForcedConfig())
    for got, want in zip(together, alone):
        got.validate()
        assert (got.tokens, got.parents, got.sources) == (want.tokens, want.parents, want.sources)
    assert together[0].path_tokens(together[0].num_nodes - 1) == chain
    assert together[2].num_draft_tokens == 5  # cut to the budget
    assert together[3] is drafts[3]
    assert (together[4].tokens, together[4].sources) == (together[0].tokens, together[0].sources)
    for matcher in (*llg, xgr):
        assert root_chain(matcher, 16) == chain  # unchanged


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_forced_chain_probes_roll_back_only_exact_matchers(
    toy_tokenizer: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probing leaves for forced chains never rolls back a matcher whose rollback is not exact
    (llguidance: a stale mask can survive it, ``test_llguidance_stale_rollback``): it probes a
    fork. Exact ones are probed in place and rolled back. Same chains either way."""
    matcher = compile_matcher(toy_tokenizer, backend)
    chain = root_chain(matcher, 16)
    builder = TreeBuilder(0)
    builder.add_path(0, chain[:1], [-0.1], NodeSource.MODEL)
    rollbacks: list[int] = []
    original = type(matcher).rollback

    def counted(self: Any, n: int) -> None:
        if self is matcher:  # the request's own matcher, not a fork
            rollbacks.append(n)
        original(self, n)

    monkeypatch.setattr(type(matcher), "rollback", counted)
    draft = _extended(builder.build(), matcher, 32)
    assert draft.path_tokens(draft.num_nodes - 1) == chain  # the chain was grafted
    assert matcher.exact_rollback == (backend != "llguidance")
    if matcher.exact_rollback:
        assert rollbacks  # probed in place, then rolled back
    else:
        assert rollbacks == []  # a fork was probed
    assert root_chain(matcher, 16) == chain  # the matcher state is unchanged


def test_proposer_merges_forced_chain_and_drafts(toy_tokenizer: Any) -> None:
    matcher = compile_matcher(toy_tokenizer, "llguidance")
    chain = root_chain(matcher, 16)
    context = [5, 6, *chain[:1], 7, 5, 6]  # the n-gram "5 6" was followed by the chain's head
    proposer = Proposer({"ngram": NgramDrafter(NgramConfig(min_n=2, max_n=2))})
    [draft] = proposer.propose([ProposalItem("p", context, matcher, ("ngram", "forced"), 8)])
    draft.validate()
    assert draft.path_tokens(len(chain)) == chain  # the chain comes first
    assert all(draft.sources[i] == NodeSource.FORCED for i in range(1, len(chain) + 1))
    assert draft.num_draft_tokens <= 8
    [plain] = proposer.propose([ProposalItem("q", context, None, ("ngram",), 8)])
    assert plain.path_tokens(1) == chain[:1]  # n-gram only, unconstrained


def test_draft_model_tree_shape(toy_tokenizer: Any) -> None:
    from espalier.engine.spec.draft_model import DraftModelConfig, DraftModelDrafter

    small = random_runner(tiny_config(toy_tokenizer.vocab_size, layers=1), seed=4)
    drafter = DraftModelDrafter(small, DraftModelConfig(topk=3, steps=4))
    inputs = [DraftInput("a", [1, 2, 3, 4], (), 10), DraftInput("b", [7, 8], (9, 10), 5)]
    drafts = drafter.propose(inputs)
    for item, draft in zip(inputs, drafts):
        draft.validate()
        assert draft.tokens[0] == [*item.context, *item.extra][-1]
        assert draft.num_draft_tokens == item.budget
        assert max(draft.depths()) <= 4
        assert all(
            draft.scores[i] <= draft.scores[draft.parents[i]] for i in range(1, draft.num_nodes)
        )
    drafter.release("a")
    drafter.release("b")
    assert drafter.allocator.num_free_blocks == drafter.allocator.num_blocks


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle_checkpoint_round_trip(
    tmp_path: Path, toy_tokenizer: Any, kind: str, fmt: str
) -> None:
    """A head saved under the published key names loads back identical (kind from the keys)."""
    from espalier.engine.spec.eagle import load_eagle

    target = random_runner(tiny_config(toy_tokenizer.vocab_size), seed=0)
    head = random_eagle(target, kind, seed=1, draft_vocab=64 if kind == "eagle3" else 0)
    state = {k: v.contiguous() for k, v in head.state_dict().items() if k != "embed_tokens.weight"}
    if kind == "eagle3":
        state["t2d"] = torch.zeros(toy_tokenizer.vocab_size, dtype=torch.bool)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(tmp_path / "model.safetensors"))
    else:
        torch.save(state, tmp_path / "pytorch_model.bin")
    c = head.config
    config = {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "vocab_size": c.vocab_size,
        "num_hidden_layers": 1,
        "draft_vocab_size": c.draft_vocab_size,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_eagle(tmp_path, target.model.model.embed_tokens.weight)
    assert loaded.config.kind == kind
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_parse_methods_and_build_drafters(toy_tokenizer: Any) -> None:
    from espalier.engine.spec.setup import build_drafters, parse_methods

    assert parse_methods("off") == ()
    assert parse_methods("ngram, forced,ngram") == ("ngram", "forced")
    with pytest.raises(ValueError, match="unknown speculative method"):
        parse_methods("ngram,medusa")
    target = random_runner(tiny_config(toy_tokenizer.vocab_size), seed=0)
    assert set(build_drafters(("ngram", "forced"), target)) == {"ngram"}
    with pytest.raises(ValueError, match="--draft-model"):
        build_drafters(("draft",), target)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_mask_budget_stretches_to_the_forward_running_alongside(
    toy_tokenizer: Any, backend: str
) -> None:
    # A budget of 0 s starts no node past the root; a forward expected to run 60 s alongside
    # the fills stretches it so the whole forced chain is filled (on the CPU, where fills share
    # the cores with a forward of hundreds of ms, a fixed 2 ms budget cut every forced chain of
    # `espalier generate --local --speculative forced`).
    from espalier.engine.spec.masks import MaskBuilder

    matcher = compile_matcher(toy_tokenizer, backend)
    chain = root_chain(matcher, 16)
    assert len(chain) >= 2
    builder = TreeBuilder(0)
    builder.add_path(0, chain, None, NodeSource.FORCED)
    draft = builder.build()
    masks = MaskBuilder(toy_tokenizer.vocab_size, threads=1, budget_s=0.0)
    try:
        cut = masks.submit([matcher], [draft]).result()
        assert cut.filled.tolist() == [True] + [False] * len(chain)
        full = masks.submit([matcher], [draft], hidden_s=60.0).result()
        assert full.filled.tolist() == [True] * (len(chain) + 1)
        assert full.valid.tolist() == [True] * (len(chain) + 1)
    finally:
        masks.close()


def test_max_drafted_caps_the_drafters_not_the_forced_chain(toy_tokenizer: Any) -> None:
    matcher = compile_matcher(toy_tokenizer, "llguidance")
    chain = root_chain(matcher, 16)
    context = [5, 6, *chain[:1], 7, 8, 9, 5, 6]  # "5 6" was followed by a long continuation
    proposer = Proposer({"ngram": NgramDrafter(NgramConfig(min_n=2, max_n=2))})
    [free] = proposer.propose([ProposalItem("a", context, None, ("ngram",), 8)])
    [capped] = proposer.propose([ProposalItem("b", context, None, ("ngram",), 8, 1)])
    assert free.num_draft_tokens > 1 and capped.num_draft_tokens == 1
    assert capped.path_tokens(1) == free.path_tokens(1)  # the best drafted node stays
    [forced] = proposer.propose([ProposalItem("c", context, matcher, ("ngram", "forced"), 16, 1)])
    assert forced.path_tokens(len(chain)) == chain  # the chain is whole
    assert sum(s != NodeSource.FORCED for s in forced.sources[1:]) <= 1


def test_adaptive_drafts_follow_what_was_accepted() -> None:
    from espalier.engine.spec.strategy import SpecConfig, SpeculativeDecoding

    strategy = SpeculativeDecoding.__new__(SpeculativeDecoding)  # the rule alone: no model
    strategy.config = SpecConfig()
    strategy._accepted = {}
    assert strategy._max_drafted("r", 8) is None  # no evidence yet: the whole budget
    for rate, cap in [(0.0, 1), (0.4, 2), (0.75, 3), (2.0, 5), (6.0, 8)]:
        strategy._accepted["r"] = rate
        assert strategy._max_drafted("r", 8) == cap
    strategy.config = SpecConfig(adaptive_drafts=False)
    assert strategy._max_drafted("r", 8) is None


def _chains(tokenizer: Any, n: int) -> tuple[list[Any], list[Draft]]:
    """``n`` fresh llguidance matchers, each with a draft of its forced chain (8 tokens)."""
    matchers = [compile_matcher(tokenizer, "llguidance") for _ in range(n)]
    drafts = []
    for matcher in matchers:
        builder = TreeBuilder(0)
        builder.add_path(0, root_chain(matcher, 8), None, NodeSource.FORCED)
        drafts.append(builder.build())
    return matchers, drafts


@pytest.mark.parametrize("threads", [1, 3])
def test_after_jobs_start_when_the_last_fill_ends(toy_tokenizer: Any, threads: int) -> None:
    # MaskBuilder.submit's `after` jobs (the closing decisions made ahead) must not compete
    # with the fills for the GIL: each one sees every fill of its step finished, and is given
    # the step's `filled` flags (every node of every draft, in order).
    import threading

    from espalier.engine.spec.masks import MaskBuilder

    matchers, drafts = _chains(toy_tokenizer, 4)
    masks = MaskBuilder(toy_tokenizer.vocab_size, threads=threads)
    seen: list[list[bool]] = []
    given: list[list[bool]] = []
    submitted = threading.Event()
    pending: list[Any] = []

    def after(filled: Any) -> None:
        assert submitted.wait(10.0)
        seen.append([part is not None for part in pending[0].fills.results])
        given.append(filled.tolist())

    try:
        pending.append(masks.submit(matchers, drafts, [after, after]))
        submitted.set()
        result = pending[0].result()
        masks.close()  # waits for the pool, so both after jobs have run
        assert seen == [[True] * 4, [True] * 4]
        assert result.valid.all()
        assert given == [result.filled.tolist()] * 2
        assert len(given[0]) == sum(d.num_nodes for d in drafts)
        # no fills at all (unconstrained requests only): they start at once, every node filled
        idle = MaskBuilder(toy_tokenizer.vocab_size, threads=threads)
        idle.submit([None], [drafts[0]], [lambda filled: given.append(filled.tolist())])
        idle.close()
        assert given[2] == [True] * drafts[0].num_nodes
    finally:
        masks.close()


def test_a_steps_llguidance_trees_fill_in_one_batch_as_each_alone(toy_tokenizer: Any) -> None:
    # MaskBuilder hands every llguidance tree (its key filter too) to one native tree batch and
    # fills the others (xgrammar here) one by one: each request's rows and flags equal its own
    # fill_tree; unconstrained requests are all valid, with no rows.
    import numpy as np

    from espalier.constrained.keys import with_unique_keys
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.spec.masks import MaskBuilder

    free = {"type": "object", "additionalProperties": {"type": "integer"}}
    spec = GrammarSpec.json_schema(free)

    def request(backend: str) -> tuple[Any, Any]:
        one, two = (compile_matcher(toy_tokenizer, backend, free) for _ in range(2))
        if backend == "llguidance":
            assert one.compiled.native_slot.wait(60) is not None
        prefix = toy_tokenizer.encode('{"a":1,"b":2,"')
        pair = tuple(with_unique_keys(spec, m, toy_tokenizer) for m in (one, two))
        assert all(m.accept_tokens(prefix) == len(prefix) for m in pair)
        return pair

    pairs = [request("llguidance"), request("xgrammar"), request("llguidance")]
    rng = random.Random(4)
    drafts = []
    for _ in range(4):
        builder = TreeBuilder(0)
        for _ in range(3):  # a few branches of plausible key text, some repeating "a"/"b"
            path = toy_tokenizer.encode(rng.choice(['a":3}', 'b":4,"c', 'c":5}', 'ab":6}']))
            builder.add_path(0, path, None, NodeSource.FORCED)
        drafts.append(builder.build())
    matchers = [pairs[0][0], None, pairs[1][0], pairs[2][0]]
    masks = MaskBuilder(toy_tokenizer.vocab_size, threads=2)
    try:
        pending = masks.submit(matchers, drafts)
        assert len(pending.fills.jobs) == 2  # one batch (both llguidance trees), one xgrammar
        result = pending.result()
        assert pending.faults() == {}
        rows = result.bitmask.numpy()
        alone_of = {0: pairs[0][1], 2: pairs[1][1], 3: pairs[2][1]}
        node = row = 0
        for index, draft in enumerate(drafts):
            n = draft.num_nodes
            valid = result.valid[node : node + n].numpy()
            filled = result.filled[node : node + n].numpy()
            if index not in alone_of:
                assert valid.all() and filled.all()
                assert result.mask_rows[node : node + n].tolist() == [-1] * n
            else:
                tree = DraftTree(draft.tokens, *sibling_links(draft.parents))
                out = np.zeros((n, rows.shape[1]), dtype=np.int32)
                alone = alone_of[index].fill_tree(tree, out, budget=None)
                assert np.array_equal(rows[row : row + n], out)
                assert np.array_equal(valid, alone.valid) and np.array_equal(filled, alone.filled)
                assert not alone.valid.all()  # the key filter cut a repeated key
                assert result.mask_rows[node : node + n].tolist() == list(range(row, row + n))
                row += n
            node += n
    finally:
        masks.close()
