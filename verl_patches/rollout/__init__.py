"""Framework-free pieces of the recipe's vLLM rollout: the DP domain, the DP agreement, KV cache re-init.

Plain torch / torch.distributed; the patch modules under verl_patches/patches/ bind them to vLLM and verl.
"""
