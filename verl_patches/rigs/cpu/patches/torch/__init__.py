"""CPU-platform patches of torch 2.5.1: the CUDA runtime calls megatron-core makes."""
