"""The embedded default model (Gemma 3 270M, GGUF q4_k_m) against transformers' own GGUF loader.

transformers dequantizes the same file independently (``from_pretrained(dir, gguf_file=...)``);
our converted checkpoint must hold the same weights, and greedy decoding through our paged
runner (all prompts batched) must emit transformers' greedy tokens, token for token.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from espalier.engine.config import CacheConfig, RunnerConfig
from espalier.engine.kv_cache import BlockAllocator, blocks_needed
from espalier.engine.model.runner import ModelRunner, SeqInput
from espalier.server.default_model import default_gguf

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", '{"name": "Ada", "age":']
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner.from_pretrained(
        default_gguf(), RunnerConfig(cache=CacheConfig(num_blocks=32))
    )


@pytest.fixture(scope="module")
def reference() -> Any:
    from transformers import AutoModelForCausalLM

    path = default_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def prompt_ids(text: str) -> list[int]:
    from espalier.engine.model.weights import load_tokenizer

    tokenizer = load_tokenizer(default_gguf())
    return [tokenizer.hf.bos_token_id, *tokenizer.encode(text)]


def test_converted_weights_equal_transformers(runner: ModelRunner, reference: Any) -> None:
    ours = runner.model.state_dict()
    theirs = reference.state_dict()
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_greedy_matches_transformers(runner: ModelRunner, reference: Any) -> None:
    prompts = [prompt_ids(text) for text in PROMPTS]
    allocator = BlockAllocator(runner.num_blocks)
    tables = [
        allocator.allocate(blocks_needed(len(p) + NEW_TOKENS, runner.block_size)) for p in prompts
    ]
    seqs = [list(p) for p in prompts]
    out = runner.forward([SeqInput(block_table=t, token_ids=s) for t, s in zip(tables, seqs)])
    for _ in range(NEW_TOKENS):
        for seq, token in zip(seqs, out.logits.argmax(-1).tolist()):
            seq.append(token)
        steps = [
            SeqInput(block_table=t, token_ids=s[-1:], context_len=len(s) - 1)
            for t, s in zip(tables, seqs)
        ]
        out = runner.forward(steps)
    for prompt, seq in zip(prompts, seqs):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )[0].tolist()
        # transformers stops after an end-of-sequence token; we decode on regardless
        assert len(expected) > len(prompt) and seq[: len(expected)] == expected
