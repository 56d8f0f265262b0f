"""Lossless greedy speculative decoding: speculative output == plain constrained greedy output,
token for token, for every drafter, with and without a grammar, batch 1 and mixed batches.

The oracle (``plain_greedy``) recomputes the whole sequence every step: no KV reuse, no trees.
Correctness must not depend on acceptance, so the random models accept little; the target as
its own draft model accepts everything.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from espalier.engine.spec.combine import Proposer
from espalier.engine.spec.decoder import SpeculativeDecoder
from espalier.engine.spec.masks import MaskBuilder
from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
from tests.fixtures.spec_helpers import (
    compile_matcher,
    plain_greedy,
    random_eagle,
    random_runner,
    tiny_config,
)
from tests.fixtures.spec_loop import LoopRequest, SpecLoop

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [40, 41, 42, 43, 44, 45, 40, 41, 42],
    [99],
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend on the shared CI cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runner(toy_tokenizer: Any) -> Any:
    return random_runner(tiny_config(toy_tokenizer.vocab_size), seed=0)


def make_loop(runner: Any, **drafters: Any) -> SpecLoop:
    proposer = Proposer(drafters)
    return SpecLoop(SpeculativeDecoder(runner, proposer, MaskBuilder(runner.vocab_size)))


@pytest.mark.parametrize("backend", [None, "llguidance", "xgrammar"])
@pytest.mark.parametrize("methods", [("ngram",), ("forced",), ("ngram", "forced")])
def test_batch1_matches_plain(
    runner: Any, toy_tokenizer: Any, backend: str | None, methods: tuple[str, ...]
) -> None:
    stops = frozenset(toy_tokenizer.stop_token_ids)
    loop = make_loop(runner, ngram=NgramDrafter(NgramConfig(min_n=1, max_n=3)))
    for prompt in PROMPTS[:2]:
        spec_matcher = compile_matcher(toy_tokenizer, backend) if backend else None
        plain_matcher = compile_matcher(toy_tokenizer, backend) if backend else None
        [result] = loop.generate([LoopRequest("r", prompt, 24, spec_matcher, methods, 6, stops)])
        expected = plain_greedy(runner, prompt, 24, matcher=plain_matcher, stop_ids=stops)
        assert result.output_ids == expected
        stats = result.stats
        assert stats.steps + stats.accepted_tokens >= len(expected)
        assert stats.accepted_tokens <= stats.draft_tokens


def test_mixed_batch_matches_plain(runner: Any, toy_tokenizer: Any) -> None:
    """Speculating and plain requests, constrained and not, several drafters, one batch."""
    stops = frozenset(toy_tokenizer.stop_token_ids)
    loop = make_loop(runner, ngram=NgramDrafter(NgramConfig(min_n=1, max_n=3)))
    setups = [
        (PROMPTS[0], "llguidance", ("ngram", "forced"), 8),
        (PROMPTS[1], None, ("ngram",), 4),
        (PROMPTS[2], "xgrammar", ("forced",), 5),
        (PROMPTS[0], None, (), 0),  # does not speculate
        (PROMPTS[1], "llguidance", (), 0),  # constrained, does not speculate
    ]
    requests = [
        LoopRequest(f"r{i}", p, 20, compile_matcher(toy_tokenizer, b) if b else None, m, n, stops)
        for i, (p, b, m, n) in enumerate(setups)
    ]
    results = loop.generate(requests)
    for (prompt, backend, _, _), result in zip(setups, results):
        matcher = compile_matcher(toy_tokenizer, backend) if backend else None
        assert result.output_ids == plain_greedy(
            runner, prompt, 20, matcher=matcher, stop_ids=stops
        )
    assert results[3].stats.draft_tokens == 0
    assert loop.allocator.num_free_blocks == runner.num_blocks  # every block came back


@pytest.mark.parametrize(("threads", "eager_every"), [(1, 0), (3, 0), (3, 2)])
def test_masks_after_launch_match_plain(
    runner: Any, toy_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, threads: int, eager_every: int
) -> None:
    """The CUDA order (forward launched, then the fills, shared by the pool and the waiting
    thread) gives the same tokens as plain decoding, constrained and not, in one batch.
    ``eager_every``: every that many steps the forward is one no CUDA graph fits
    (``ModelRunner.replays`` False, as on a GPU), and its fills start before it instead."""
    stops = frozenset(toy_tokenizer.stop_token_ids)
    proposer = Proposer({"ngram": NgramDrafter(NgramConfig(min_n=1, max_n=3))})
    masks = MaskBuilder(runner.vocab_size, threads=threads)
    steps: list[list[str]] = []  # per verify step: "replay" or "eager", then the calls in order

    def replays(batch: Any, *, hidden_layers: Any = ()) -> bool:
        replay = not eager_every or (len(steps) + 1) % eager_every != 0
        steps.append(["replay" if replay else "eager"])
        return replay

    forward, submit = runner.forward, masks.submit

    def recording_forward(*args: Any, **kwargs: Any) -> Any:
        if steps:
            steps[-1].append("forward")
        return forward(*args, **kwargs)

    def recording_submit(*args: Any, **kwargs: Any) -> Any:
        if steps:
            steps[-1].append("fills")
        return submit(*args, **kwargs)

    monkeypatch.setattr(runner, "replays", replays)
    monkeypatch.setattr(runner, "forward", recording_forward)
    monkeypatch.setattr(masks, "submit", recording_submit)
    loop = SpecLoop(SpeculativeDecoder(runner, proposer, masks, launch_first=True))
    setups = [
        (PROMPTS[0], "llguidance", ("ngram", "forced")),
        (PROMPTS[1], "xgrammar", ("ngram", "forced")),
        (PROMPTS[2], None, ("ngram",)),
        (PROMPTS[1], "llguidance", ("forced",)),
    ]
    requests = [
        LoopRequest(f"r{i}", p, 20, compile_matcher(toy_tokenizer, b) if b else None, m, 6, stops)
        for i, (p, b, m) in enumerate(setups)
    ]
    try:
        results = loop.generate(requests)
    finally:
        masks.close()
    for (prompt, backend, _), result in zip(setups, results):
        matcher = compile_matcher(toy_tokenizer, backend) if backend else None
        expected = plain_greedy(runner, prompt, 20, matcher=matcher, stop_ids=stops)
        assert result.output_ids == expected
    assert len(steps) > 4
    for step in steps:  # a step's own calls come first (prefill or oracle forwards follow)
        fills_first = ["fills", "forward"] if step[0] == "eager" else ["forward", "fills"]
        assert step[1:3] == fills_first, steps
    assert any(step[0] == "eager" for step in steps) == bool(eager_every)


def test_sliding_window_target_matches_plain(toy_tokenizer: Any) -> None:
    """Compaction keeps the 'position == cache index' contract sliding-window layers rely on."""
    runner = random_runner(tiny_config(toy_tokenizer.vocab_size, window=6), seed=3)
    loop = make_loop(runner, ngram=NgramDrafter(NgramConfig(min_n=1, max_n=2)))
    prompt = PROMPTS[0] * 2
    [result] = loop.generate([LoopRequest("w", prompt, 30, None, ("ngram",), 6)])
    assert result.output_ids == plain_greedy(runner, prompt, 30)


def draft_drafter(runner: Any, topk: int = 2, steps: int = 3) -> Any:
    from espalier.engine.spec.draft_model import DraftModelConfig, DraftModelDrafter

    return DraftModelDrafter(runner, DraftModelConfig(topk=topk, steps=steps))


@pytest.mark.parametrize("backend", [None, "xgrammar"])
def test_draft_model_matches_plain(runner: Any, toy_tokenizer: Any, backend: str | None) -> None:
    """A random (unrelated) draft model: low acceptance, same output; batch of 3 + a plain one."""
    stops = frozenset(toy_tokenizer.stop_token_ids)
    small = random_runner(tiny_config(toy_tokenizer.vocab_size, layers=1), seed=7)
    loop = make_loop(runner, draft=draft_drafter(small))
    requests = [
        LoopRequest(
            f"d{i}",
            prompt,
            16,
            compile_matcher(toy_tokenizer, backend) if backend else None,
            ("draft", "forced") if i else ("draft",),
            6 if i < 3 else 0,
            stops,
        )
        for i, prompt in enumerate([*PROMPTS, PROMPTS[0]])
    ]
    results = loop.generate(requests)
    for request, result in zip(requests, results):
        matcher = compile_matcher(toy_tokenizer, backend) if backend else None
        expected = plain_greedy(runner, request.prompt_ids, 16, matcher=matcher, stop_ids=stops)
        assert result.output_ids == expected


def test_target_as_its_own_draft_model_accepts_everything(runner: Any, toy_tokenizer: Any) -> None:
    """Draft = the target's weights in a second runner: every drafted chain token is accepted."""
    twin = random_runner(tiny_config(toy_tokenizer.vocab_size), seed=0)
    loop = make_loop(runner, draft=draft_drafter(twin, topk=1, steps=4))
    [result] = loop.generate([LoopRequest("t", PROMPTS[1], 25, None, ("draft",), 4)])
    assert result.output_ids == plain_greedy(runner, PROMPTS[1], 25)
    stats = result.stats
    assert stats.accepted_tokens == stats.draft_tokens > 0
    assert stats.steps == 5  # 25 tokens, 4 accepted + 1 bonus per step


@pytest.mark.parametrize(("kind", "backend"), [("eagle1", None), ("eagle3", "llguidance")])
def test_eagle_head_matches_plain(
    runner: Any, toy_tokenizer: Any, kind: str, backend: str | None
) -> None:
    """Random-weight EAGLE / EAGLE-3 heads (EAGLE-3 with a 120-token draft vocabulary)."""
    from espalier.engine.spec.draft_model import DraftModelConfig
    from espalier.engine.spec.eagle_drafter import EagleDrafter

    stops = frozenset(toy_tokenizer.stop_token_ids)
    head = random_eagle(runner, kind, seed=5, draft_vocab=120 if kind == "eagle3" else 0)
    drafter = EagleDrafter(head, runner, DraftModelConfig(topk=3, steps=3), num_blocks=128)
    loop = make_loop(runner, eagle=drafter)
    methods = ("eagle", "forced") if backend else ("eagle",)
    requests = [
        LoopRequest(
            f"e{i}",
            p,
            16,
            compile_matcher(toy_tokenizer, backend) if backend else None,
            methods,
            6 if i < 2 else 0,
            stops,
        )
        for i, p in enumerate(PROMPTS)
    ]
    results = loop.generate(requests)
    for request, result in zip(requests, results):
        matcher = compile_matcher(toy_tokenizer, backend) if backend else None
        expected = plain_greedy(runner, request.prompt_ids, 16, matcher=matcher, stop_ids=stops)
        assert result.output_ids == expected
    assert results[0].stats.draft_tokens > 0
    assert drafter.allocator.num_free_blocks == drafter.allocator.num_blocks
