"""Espalier: grammar-constrained LLM generation with tree speculative decoding.

The repository root is the ``espalier`` package (see ``pyproject.toml``): ``constrained/`` installs
as ``espalier.constrained``, ``kernels/`` as ``espalier.kernels``, and so on.
"""

__version__ = "0.1.0"
