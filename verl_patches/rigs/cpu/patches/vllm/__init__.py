"""CPU-platform patches of vLLM 0.9.1: one module per vLLM module patched."""
