"""Patch overlay for GRPO post-training of DeepSeek-V3 with verl, Megatron and vLLM.

Importing this package (or any module of it but ``prelude_patch``) changes nothing;
``from verl_patches import prelude_patch`` applies the patches of the current process.
"""

__version__ = "0.1.0"
