"""Espalier engine/spec package."""
