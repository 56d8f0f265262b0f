"""Espalier constrained/backends package."""
