"""Patches of vLLM-Ascend 0.9.1: one module per vLLM-Ascend module patched."""
