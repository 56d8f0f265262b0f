"""Espalier engine/models package."""
