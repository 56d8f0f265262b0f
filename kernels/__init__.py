"""Espalier kernels: Triton kernels on CUDA, each with a pure-torch twin (``reference``).

- ``bitmask.apply_bitmask_``: disallowed logits to ``-inf``, in place (sector-level writes).
- ``verify.verify_greedy``: fused masked greedy verification of draft trees (one logits read).
- ``sampling``: constrained sampling (flashinfer on CUDA when installed) and lossless tree
  speculative sampling.

Import the submodules directly; this package imports nothing at import time.
"""
