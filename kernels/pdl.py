"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A decode step at batch 1 is ~9 short kernels per layer in a row (norm, QKV GEMV, rope, attention,
O GEMV, norm, gate/up, activation, down GEMV), each waiting for the one before. Without PDL a
kernel's programs start only after the previous kernel has finished and drained: the gap and
the ramp-up of every launch are idle memory bandwidth. With PDL (sm90+, ``launch_pdl=True``):

- each kernel calls ``launch_dependents`` once its own programs need no more launching help:
  first thing in the small kernels, after the K loop in the GEMV (``gemv.LAUNCH_NEXT_AFTER_LOOP``).
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
follows it sees the implicit trigger at that kernel's end, so mixing is safe. ``pdl(device)``
says whether launches on a device use it; ``PDL = False`` turns it off everywhere.

H200, 8B-Llama decode in CUDA graphs (``bench/gpu.py`` run 79, share of the HBM roofline,
median of 5 ABBA reps, the default GEMV variants): batch 1 0.825 with PDL against 0.802
without (graph replay 3.999 vs 4.123 ms); batch 8 0.759 vs 0.762 and batch 64 0.636 vs 0.637,
within the reps' spread.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

PDL = True
"""Launch the decode-path kernels with programmatic dependent launch where the device has it;
False: plain stream order (the anchor path ``flashinfer_graphs_no_pdl`` of ``bench/gpu.py``).
Read per launch, so a CUDA graph keeps the choice made when it was captured."""


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def pdl(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use PDL: ``PDL`` is on and ``device`` is a CUDA
    device of compute capability 9.0 or newer (never the CPU interpreter)."""
    if not PDL or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else 0) >= (9, 0)


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
