"""Which implementation a kernel call runs: Triton on CUDA, the torch twin on CPU.

``backend="auto"`` picks Triton for CUDA tensors and the pure-torch twin in
:mod:`espalier.kernels.reference` for CPU tensors. ``backend="triton"`` on CPU tensors runs the
kernels in Triton's interpreter (``TRITON_INTERPRET=1``, which tests/kernels switches on): the
kernel tests ask for it explicitly, so an engine sharing the test process keeps the fast twin.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]


def interpreter_on() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (read per call, never at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(tensor: torch.Tensor, backend: Backend) -> bool:
    """Resolve ``backend`` for a call whose main operand is ``tensor``."""
    if backend == "torch":
        return False
    if backend == "triton":
        if not (tensor.is_cuda or interpreter_on()):
            raise ValueError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1")
        return True
    return tensor.is_cuda


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def cuda_index(device: torch.device) -> int:
    """The CUDA device ordinal of ``device`` (``cuda`` without an index: 0)."""
    return device.index if device.index is not None else 0


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 2 for the interpreter (small test grids)."""
    return _sm_count(cuda_index(device)) if device.type == "cuda" else 2


def target_programs(device: torch.device) -> int:
    """Programs one launch should have to fill the device (4 per SM); small on the interpreter."""
    return 4 * sm_count(device)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()
