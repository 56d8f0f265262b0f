"""Espalier engine package."""
