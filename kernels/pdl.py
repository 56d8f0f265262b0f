"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A decode step at batch 1 is ~9 short kernels per layer in a row (norm, QKV GEMV, rope, attention,
O GEMV, norm, gate/up, activation, down GEMV), each waiting for the one before. Without PDL a
kernel's programs start only after the previous kernel has finished and drained: the gap and
the ramp-up of every launch are idle memory bandwidth. With PDL (sm90+, ``launch_pdl=True``):

- each kernel calls ``launch_dependents`` once its own programs need no more launching help:
  first thing in the small kernels, after the K loop in the GEMV (``kernels/gemv.py``).
  The next kernel is launched when every program of this one has called it or exited, so the
  programs of this kernel are all resident by then and the next kernel's waiting programs
  cannot starve them;
- each kernel calls ``wait_previous`` before it reads anything the previous kernel may have
  written and before it writes anything at all (``griddepcontrol.wait``: returns when the
  previous kernel has completed and its writes are visible). Every program waits before it
  exits, so a kernel never completes before the one it follows: the ordering is transitive,
  and a kernel two launches back is complete too.
- Loads of data no kernel of the step writes (weights, norm weights, constant metadata
  uploaded before the step) may go before the wait: the GEMV fetches its first weight tile
  while the previous kernel finishes.

A kernel launched without PDL (cuBLAS, torch) waits for full completion as usual, and one that
follows it sees the implicit trigger at that kernel's end, so mixing is safe. ``pdl(device,
rows, options)`` says whether a launch uses it: on sm90+, for steps of one token
(``KernelOptions.pdl_max_rows``); ``KernelOptions(pdl=False)`` turns it off for a model. Why
only one row, with the H200 numbers: ``docs/decisions/pdl-one-row-steps.md``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from espalier.kernels._dispatch import cuda_index
from espalier.kernels.options import KernelOptions


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def pdl(device: torch.device, rows: int, options: KernelOptions) -> bool:
    """Whether a kernel launched on ``device`` over ``rows`` token rows uses PDL: ``options.pdl``
    is on, ``rows <= options.pdl_max_rows`` and ``device`` is a CUDA device of compute
    capability 9.0 or newer (never the CPU interpreter). Every kernel of a step sees the step's
    rows and its model's options, so a step's chain is all PDL or none (mixing would be safe
    too: see the module docstring)."""
    if not options.pdl or rows > options.pdl_max_rows or device.type != "cuda":
        return False
    return _capability(cuda_index(device)) >= (9, 0)


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel of the stream launch (once every program of this one has called
    this or exited). A no-op without ``USE_PDL``."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_previous(USE_PDL: tl.constexpr):
    """Block until the previous kernel of the stream has completed and its writes are visible.
    A no-op without ``USE_PDL``."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
