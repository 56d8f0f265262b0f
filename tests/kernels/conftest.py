"""Kernel tests run the Triton kernels in Triton's CPU interpreter (scripts/test.sh sets it).

Without CUDA the interpreter is switched on here (before any kernel module is imported, since
``triton.jit`` reads it when decorating), so the CPU tests always exercise the Triton code path.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        raise RuntimeError("kernel tests on CPU need TRITON_INTERPRET=1 (scripts/test.sh sets it)")
