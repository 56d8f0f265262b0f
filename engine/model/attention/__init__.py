"""Attention backends of the model forward (torch SDPA, flashinfer, the small-query kernel)."""
