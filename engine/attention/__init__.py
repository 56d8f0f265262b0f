"""Espalier engine/attention package."""
