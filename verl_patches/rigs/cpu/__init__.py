"""The CPU platform: stand-ins for what has no CPU implementation, so the recipe's loop runs without
an accelerator (the tiny run in CI, a laptop). Applied only by patch records with platforms=("cpu",).

Nothing here runs on NPU or CUDA. Each stand-in says what it replaces: CUDA runtime calls that
megatron-core makes unconditionally (``cuda_runtime``), Transformer Engine's attention and norms
(``megatron_layers``), and vLLM's kernels (``engine``: the real vLLM model receives the reshard,
transformers' DeepseekV3 generates from those very tensors); vLLM's platform on the host (``vllm_platform``, the
plugin pyproject.toml registers, and ``vllm_host_platform``, the platform class it names). The records that
install them live in ``patches/<upstream>/``.
"""
