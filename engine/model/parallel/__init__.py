"""Tensor parallelism on one host: ranks, sharded weights and layers, the rank-0 runner.

Rank 0 runs the whole engine (scheduler, grammar work, sampling); ranks 1..N-1 only run the
forward of the batches rank 0 sends them (``worker.py``). Weights are sharded per rank after
loading (``shard.py``); the sharded layers all-reduce after the row-parallel projections and
gather the vocabulary-parallel logits (``layers.py``) so that rank 0 sees full-vocabulary logits,
where the grammar mask is applied (``docs/decisions/tensor-parallel-mask.md``).
"""

from espalier.engine.model.parallel.group import ParallelConfig, RankGroup, TensorParallelError

__all__ = ["ParallelConfig", "RankGroup", "TensorParallelError"]
