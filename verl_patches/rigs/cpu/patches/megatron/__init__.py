"""CPU-platform patches of megatron-core 0.12.1: one module per megatron module patched."""
