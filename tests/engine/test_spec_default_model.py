"""Lossless greedy speculation on the embedded default model (Gemma 3 270M): the speculative
engine (n-gram + forced chains) emits exactly the plain engine's tokens, constrained and not, in
one mixed batch. Few tokens: the model is slow on CI CPUs."""

from __future__ import annotations

from typing import Any

import pytest

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import GenerationRequest, SamplingParams, SpeculativeOptions
from espalier.server.default_model import default_gguf

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "id": {"type": "integer"}},
    "required": ["name", "id"],
}
PROMPT = 'Repeat: {"name": "Ada", "id": 7} {"name": "Ada", "id": 7} {"name": "Ada",'


def requests() -> list[GenerationRequest]:
    spec = SpeculativeOptions(methods=("ngram", "forced"), num_draft_tokens=6)
    return [
        GenerationRequest(
            f"m{i}",
            prompt=PROMPT,
            sampling=SamplingParams(max_tokens=10),
            grammar=g,
            speculative=spec if i < 2 else SpeculativeOptions(enabled=False),
        )
        for i, g in enumerate([GrammarSpec.json_schema(SCHEMA), None, None])
    ]


def run(engine: Any) -> tuple[dict[str, list[int]], int]:
    for request in requests():
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    accepted = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished and out.speculative is not None:
                accepted += out.speculative.accepted_tokens
    engine.close()
    return tokens, accepted


@pytest.mark.model
def test_default_model_speculative_equals_plain() -> None:
    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.spec.ngram import NgramDrafter
    from espalier.engine.spec.strategy import SpecConfig, install

    plain_engine = Engine.from_model(default_gguf(), EngineConfig(compile_timeout_s=600))
    plain, _ = run(plain_engine)
    engine = Engine(plain_engine.config, plain_engine.runner, plain_engine.tokenizer)
    install(engine, SpecConfig(), {"ngram": NgramDrafter()})
    spec, accepted = run(engine)
    assert spec == plain
    assert accepted > 0  # the repeated prompt is easy to draft from
