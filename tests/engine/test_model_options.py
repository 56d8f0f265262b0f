"""``ModelOptions`` reach every layer of the model they were built with, and only that model:
two runners of one process built with different options keep their own (no module global)."""

from __future__ import annotations

from pathlib import Path

import pytest

from espalier.engine.config import CacheConfig, ModelOptions, RunnerConfig
from espalier.engine.model.models.layers import GatedMLP, Linear, PagedAttention, UsesOptions
from espalier.engine.model.runner import ModelRunner, SeqInput
from espalier.kernels.options import KernelOptions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.tiny_models import make_tiny_model

    directory = tmp_path_factory.mktemp("gemma3")
    make_tiny_model("gemma3", directory)
    return directory


def runner(checkpoint: Path, options: ModelOptions) -> ModelRunner:
    config = RunnerConfig(cache=CacheConfig(block_size=4, num_blocks=16), options=options)
    return ModelRunner.from_pretrained(checkpoint, config)


def test_every_layer_follows_its_models_options(checkpoint: Path) -> None:
    ablated = ModelOptions(
        skinny_gemv=False,
        fuse_residual_add=False,
        fuse_rope_store=False,
        small_query_up_to=0,
        kernels=KernelOptions(pdl=False, attention_programs_per_sm=4),
    )
    plain, other = runner(checkpoint, ModelOptions()), runner(checkpoint, ablated)
    for model, want in ((plain.model, ModelOptions()), (other.model, ablated)):
        users = [m for m in model.modules() if isinstance(m, UsesOptions)]
        kinds = {type(m) for m in users}
        assert {Linear, GatedMLP, PagedAttention, type(model)} <= kinds
        assert all(m.options == want for m in users)
    tokens = [5, 6, 7, 8, 9]
    batch = [SeqInput(block_table=[0, 1], token_ids=tokens, logits="all")]
    # on the CPU every path is the torch one: the same logits whatever the options
    assert plain.forward(batch).logits.equal(other.forward(batch).logits)
