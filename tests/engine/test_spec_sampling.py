"""Lossless speculative sampling: under speculation the emitted tokens follow plain constrained
sampling. Two samples of 1,200 generations each (plain engine vs speculative engine with the
target as its own draft model, so drafts get accepted and rejected), chi-square homogeneity test
on each of the first three tokens and on the pair of the first two, at fixed seeds."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import GenerationRequest, SamplingParams, SpeculativeOptions
from espalier.engine.engine import Engine, EngineConfig
from espalier.engine.scheduler import SchedulerConfig
from espalier.engine.spec.draft_model import DraftModelConfig, DraftModelDrafter
from espalier.engine.spec.strategy import SpecConfig, install
from tests.fixtures.spec_helpers import SCHEMA, one_thread, random_runner, tiny_config  # noqa: F401 (autouse fixture)

N = 1200
PROMPT = (5, 6, 7, 8, 9)


def sample_first_tokens(
    engine: Engine, offset: int, grammar: GrammarSpec | None
) -> tuple[list[tuple[int, ...]], int]:
    """First three tokens of N generations (-1 where one stopped earlier), accepted drafts."""
    spec = SpeculativeOptions(methods=("draft", "forced"), num_draft_tokens=6)
    for i in range(N):
        engine.add_request(
            GenerationRequest(
                f"s{i}",
                prompt_token_ids=PROMPT,
                sampling=SamplingParams(temperature=1.0, top_k=40, max_tokens=5, seed=offset + i),
                grammar=grammar,
                speculative=spec,
            )
        )
    tokens: dict[str, list[int]] = {}
    accepted = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.speculative is not None:
                accepted += out.speculative.accepted_tokens
    engine.close()
    return [tuple((t + [-1] * 3)[:3]) for t in tokens.values()], accepted


def homogeneity_p(a: list[Any], b: list[Any]) -> float:
    """Chi-square two-sample test; categories with < 10 pooled counts merged into one."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rest_a = len(a) - sum(ca[k] for k in keys)
    rest_b = len(b) - sum(cb[k] for k in keys)
    table = [[ca[k] for k in keys] + [rest_a], [cb[k] for k in keys] + [rest_b]]
    table = [list(col) for col in zip(*table) if sum(col) > 0]
    if len(table) < 2:
        return 1.0
    return float(chi2_contingency(list(zip(*table))).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("constrained", [False, True])
def test_speculative_sampling_matches_plain_distribution(
    toy_tokenizer: Any, constrained: bool
) -> None:
    config = tiny_config(toy_tokenizer.vocab_size)
    runner = random_runner(config, seed=2, num_blocks=8192, scale=3.0)
    twin = random_runner(config, seed=2, num_blocks=8192, scale=3.0)
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=N, max_num_batched_tokens=16 * N)
    )
    grammar = GrammarSpec.json_schema(SCHEMA) if constrained else None
    plain, _ = sample_first_tokens(Engine(engine_config, runner, toy_tokenizer), 0, grammar)
    engine = Engine(engine_config, runner, toy_tokenizer)
    drafter = DraftModelDrafter(twin, DraftModelConfig(topk=2, steps=3))
    install(engine, SpecConfig(), {"draft": drafter})
    spec, accepted = sample_first_tokens(engine, 10 * N, grammar)
    assert accepted > N // 4  # drafts were accepted (and others rejected): a real test
    assert len(plain) == len(spec) == N
    for position in range(3):
        p = homogeneity_p([s[position] for s in plain], [s[position] for s in spec])
        assert p > 1e-3, (position, p)
    assert homogeneity_p([s[:2] for s in plain], [s[:2] for s in spec]) > 1e-3
    assert drafter.allocator.num_free_blocks == drafter.allocator.num_blocks
