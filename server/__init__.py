"""Espalier server package."""
