"""The kernel paths a model takes, as one frozen object fixed at construction.

Each field is a decision the H200 measurements made (the defaults, ``docs/decisions/``); the
other values are the anchors ``bench/gpu.py`` and ``bench/attention.py`` time against and the
ablations some tests compare with. A model or attention backend gets its ``KernelOptions`` when
it is built (``engine.config.ModelOptions.kernels``) and passes it to every launch, so a CUDA
graph keeps the paths of the model it was captured from, and two models in one process can
differ.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionLaunch:
    """Small-query attention launch shape: K/V entries per loop step (a multiple of 32), warps
    and software-pipeline stages."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class KernelOptions:
    """Which path each launch-level decision takes.

    - ``pdl``: decode-path kernels use programmatic dependent launch where the device has it
      (sm90+; ``kernels/pdl.py``); False: plain stream order.
    - ``pdl_max_rows``: PDL only for launches over at most this many token rows (one: above it
      PDL lost 1-1.5 % at every batch, ``docs/decisions/pdl-one-row-steps.md``).
    - ``gate_up_m1_under_pdl``: at M = 1 under PDL the fused gate/up projection runs the skinny
      GEMM, not cuBLAS, so the chain of early launches is not broken (``gemv.preferred``).
    - ``attention_programs_per_sm``: programs a small-query attention launch aims at per SM
      when it picks its KV splits (one: more won on long decode contexts but lost 2x on
      tree-verify steps, ``docs/decisions/small-query-attention.md``).
    - ``attention_launch``: the small-query attention launch shape for every head dim; None:
      the per-head-dim default (``paged_attention.launch_config``).
    """

    pdl: bool = True
    pdl_max_rows: int = 1
    gate_up_m1_under_pdl: bool = True
    attention_programs_per_sm: int = 1
    attention_launch: AttentionLaunch | None = None


DEFAULT_KERNELS = KernelOptions()
"""The measured winners: what every launch uses unless its model was built with other options."""
