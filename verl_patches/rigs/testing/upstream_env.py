"""Make the real upstream stack importable in the CPU test environment (no NPU, no CUDA).

Only for tests and local tools: on the cluster vLLM-Ascend's own platform plugin does this.
"""

from __future__ import annotations

import os

from verl_patches.rigs.cpu.vllm_platform import torch251_custom_op_compat


def prepare_cpu_upstream() -> None:
    """Idempotent. Call before importing vLLM model code in a CPU process.

    1. VLLM_PLUGINS: vLLM-Ascend registers a platform plugin that imports torch_npu;
       only our own plugin may load here.
    2. torch 2.5.1's custom-op fix for vLLM 0.9.1 (verl_patches/rigs/cpu/vllm_platform.py; in a run,
       vLLM's platform-plugin entry point applies it).
    """
    os.environ.setdefault("VLLM_PLUGINS", "verl_patches")

    torch251_custom_op_compat()
