"""The model and how it runs: the runner (forward passes over the paged KV cache), CUDA graphs and
their padding, attention backends, architectures (``models/``), weights and GGUF loading."""
