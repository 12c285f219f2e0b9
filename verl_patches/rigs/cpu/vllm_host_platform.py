"""vLLM's own CPU platform, declared out-of-tree (as vLLM-Ascend's NPU platform is), for the CPU platform.

vLLM built for no device ('empty') finds no platform; its CpuPlatform assumes its compiled CPU
kernels (torch.ops._C). Marked out-of-tree, vLLM's custom ops take their native torch paths
instead. vllm.attention.ops.triton_flash_attention probes the CUDA device when imported (by the MLA
backends); on the host it is an empty module. Imported only by vLLM, when the plugin in
verl_patches/rigs/cpu/vllm_platform.py names this class.
"""

from __future__ import annotations

import sys
import types

if "vllm" not in sys.modules:
    # Importing vLLM resolves its platform, and the plugin names this module: begun from here, the
    # resolution would find this module half-built and vLLM would fail with an unrelated-looking
    # "cannot import name 'current_platform'".
    raise ImportError("verl_patches.rigs.cpu.vllm_host_platform is loaded by vLLM itself when it resolves its "
                      "platform: import vllm first")

from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.platforms.interface import PlatformEnum

_TRITON_FA = "vllm.attention.ops.triton_flash_attention"
if _TRITON_FA not in sys.modules:
    _stub = types.ModuleType(_TRITON_FA)
    _stub.__doc__ = "stand-in (CPU platform): the GPU kernel module has no host implementation"
    _stub.triton_attention = None
    sys.modules[_TRITON_FA] = _stub


class HostPlatform(CpuPlatform):
    _enum = PlatformEnum.OOT

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        # A VllmConfig without a model (vLLM's parallel-state setup, the DP-domain checks) has nothing
        # for the CPU platform's model and cache checks, which read model_config unguarded; vLLM's
        # CUDA platform skips them the same way.
        if vllm_config.model_config is None:
            return
        super().check_and_update_config(vllm_config)
