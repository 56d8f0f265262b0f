"""Speculation from settings: parse ``--speculative`` method lists, build the drafters, and switch
an engine to the speculative strategy (the composition root calls this; nothing reads flags)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from espalier.engine.spec.base import Drafter
from espalier.engine.spec.combine import FORCED
from espalier.engine.spec.draft_model import DraftModelConfig
from espalier.engine.spec.strategy import SpecConfig, install

if TYPE_CHECKING:
    from espalier.engine.engine import Engine
    from espalier.engine.model.runner import ModelRunner

METHODS = ("ngram", "draft", "eagle", FORCED)


def parse_methods(text: str) -> tuple[str, ...]:
    """``"off"`` -> ``()``; ``"ngram,forced"`` -> ``("ngram", "forced")``; ValueError if unknown."""
    if text.strip() in ("", "off", "none"):
        return ()
    methods = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown speculative method(s) {unknown}; known: {', '.join(METHODS)}")
    return methods


def build_drafters(
    methods: tuple[str, ...],
    target: ModelRunner,
    *,
    draft_model: str | os.PathLike[str] | None = None,
    eagle: str | os.PathLike[str] | None = None,
    tree: DraftModelConfig | None = None,
    draft_blocks: int = 1024,
) -> dict[str, Drafter]:
    """The drafters ``methods`` name (``forced`` needs none). ``draft`` loads ``draft_model``
    (same tokenizer as the target) on the target's device; ``eagle`` loads a local EAGLE or
    EAGLE-3 checkpoint directory."""
    drafters: dict[str, Drafter] = {}
    if "ngram" in methods:
        from espalier.engine.spec.ngram import NgramDrafter

        drafters["ngram"] = NgramDrafter()
    if "draft" in methods:
        if draft_model is None:
            raise ValueError("--speculative draft needs --draft-model PATH")
        from espalier.engine.config import CacheConfig, RunnerConfig
        from espalier.engine.model.runner import ModelRunner
        from espalier.engine.spec.draft_model import DraftModelDrafter

        config = RunnerConfig(
            device=str(target.device),
            dtype=target.config.dtype,
            attention_backend=target.config.attention_backend,
            cache=CacheConfig(block_size=target.block_size, num_blocks=draft_blocks),
        )
        small = ModelRunner.from_pretrained(draft_model, config)
        if small.vocab_size > target.vocab_size:
            raise ValueError("the draft model's vocabulary is larger than the target's")
        drafters["draft"] = DraftModelDrafter(small, tree)
    if "eagle" in methods:
        if eagle is None:
            raise ValueError("--speculative eagle needs --eagle PATH")
        if not target.full_head:  # the head reads the target's embedding and LM head
            raise ValueError("--speculative eagle does not run with tensor parallelism")
        from espalier.engine.spec.eagle import load_eagle
        from espalier.engine.spec.eagle_drafter import EagleDrafter

        head = load_eagle(eagle, target.model.model.embed_tokens.weight)
        drafters["eagle"] = EagleDrafter(head, target, tree, num_blocks=draft_blocks)
    return drafters


def enable_speculation(
    engine: Engine,
    methods: tuple[str, ...],
    *,
    num_draft_tokens: int = 8,
    **build: object,
) -> Engine:
    """Make ``engine`` speculate with ``methods`` by default (requests may still opt out)."""
    if not methods:
        return engine
    found = build_drafters(methods, engine.runner, **build)  # type: ignore[arg-type]
    config = SpecConfig(methods=methods, num_draft_tokens=num_draft_tokens)
    return install(engine, config, found)
