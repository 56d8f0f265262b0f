"""Espalier kernels package."""
