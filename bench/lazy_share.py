"""How often the target's unconstrained greedy choice is allowed by the grammar, printing JSON
lines: the measurement behind lazy verification (issue 7, item 5).

Greedy constrained decoding with the embedded Gemma 3 270M on the CPU, on JSONSchemaBench
schemas (``bench/spec.py``'s sample, llguidance), a chat prompt asking for a JSON object that
matches the schema. At every step: is the unconstrained argmax allowed by the grammar's mask?
Where it is, the masked argmax is the same token (checked), so a lazy verifier would need no mask
row for that node, only an accept check; where it is not, it needs the full row. Also the share
of steps whose mask allows one token only (forced).

    .venv/bin/python bench/lazy_share.py [--schemas 12] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import spec as spec_bench  # bench/spec.py (this folder is on sys.path)
import torch


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def decode_one(
    runner: Any, tokenizer: Any, grammar: Any, schema: Any, max_tokens: int
) -> tuple[int, int, int]:
    """Greedy constrained decoding of one request: (steps, free choice allowed, forced steps)."""
    from espalier.constrained import bitmask as bm
    from espalier.engine.model.runner import SeqInput

    text = (
        "<start_of_turn>user\nReply with one JSON object that matches this JSON schema:\n"
        + json.dumps(schema)[:1500]
        + "<end_of_turn>\n<start_of_turn>model\n"
    )
    prompt = tokenizer.encode(text)
    table = list(range((len(prompt) + max_tokens) // runner.block_size + 1))
    out = runner.forward([SeqInput(table, prompt, 0)])
    context, matcher, row = len(prompt), grammar.matcher(), bm.allocate(1, tokenizer.vocab_size)
    steps = allowed = forced = 0
    for _ in range(max_tokens):
        logits = out.logits[-1].float()
        free = int(logits.argmax())
        matcher.fill_bitmask(row, 0)
        words = row[0].numpy()
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: logits.shape[0]]
        mask = torch.from_numpy(bits.astype(bool))
        choice = int(logits.masked_fill(~mask, float("-inf")).argmax())
        ok = bool(mask[free])
        assert not ok or choice == free  # an allowed global argmax is the masked argmax
        steps, allowed, forced = steps + 1, allowed + ok, forced + (int(mask.sum()) == 1)
        if (
            choice in tokenizer.stop_token_ids
            or not matcher.accept(choice)
            or matcher.is_terminated()
        ):
            break
        out = runner.forward([SeqInput(table, [choice], context)])
        context += 1
    return steps, allowed, forced


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    from espalier.constrained.backends import get_backend
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.config import CacheConfig, RunnerConfig
    from espalier.engine.model.runner import ModelRunner
    from espalier.server.default_model import default_gguf, default_tokenizer

    tokenizer = default_tokenizer()
    config = RunnerConfig(device="cpu", cache=CacheConfig(16, 512))
    runner = ModelRunner.from_pretrained(default_gguf(), config)
    backend = get_backend("llguidance", tokenizer)
    total = [0, 0, 0]
    for name, schema, _ in spec_bench.sample_schemas(args.schemas, with_instances=False):
        try:
            grammar = backend.compile(GrammarSpec.json_schema(schema))
        except Exception:  # a schema llguidance refuses: not this measurement's subject
            continue
        steps, allowed, forced = decode_one(runner, tokenizer, grammar, schema, args.max_tokens)
        total = [total[0] + steps, total[1] + allowed, total[2] + forced]
        emit({"schema": name, "steps": steps, "free_choice_allowed": round(allowed / steps, 3)})
    emit(
        {
            "steps": total[0],
            "free_choice_allowed_share": round(total[1] / max(1, total[0]), 3),
            "single_token_mask_share": round(total[2] / max(1, total[0]), 3),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
