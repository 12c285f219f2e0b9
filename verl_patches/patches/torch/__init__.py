"""Patches of torch 2.5.1: CPU-platform stand-ins only (the CUDA runtime calls megatron-core makes)."""
