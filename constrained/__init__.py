"""Espalier constrained package."""
