"""SMG (Shepherd Model Gateway) worker protocol: ``espalier serve --smg-port`` speaks vLLM's."""
