"""vLLM's platform plugin for the CPU platform: vLLM runs as a host platform of its own, and torch
2.5.1 gets the custom-op fix vLLM 0.9.1 needs (the earliest point vLLM offers: it resolves its
platform while its first modules are imported, before any custom op is registered).

Registered in pyproject.toml under ``vllm.platform_plugins`` (``VLLM_PLUGINS`` must include
``verl_patches``). On NPU and CUDA it returns None and changes nothing: vLLM-Ascend's plugin and
vLLM's CUDA platform take over, and vLLM-Ascend applies the same custom-op fix itself.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

from verl_patches.rigs import npu_rehearsal
from verl_patches.base import accelerator
import torch

COMPAT_MODULE = "_vllm_ascend_torch251_custom_op_compat"
HOST_PLATFORM = "verl_patches.rigs.cpu.vllm_host_platform.HostPlatform"


def torch251_custom_op_compat() -> bool:
    """torch < 2.6 cannot infer custom-op schemas from PEP 585 annotations (``list[int]``), which
    vLLM 0.9.1 (built for torch 2.7) uses. vLLM-Ascend ships the fix
    (vllm_ascend/patch/worker/patch_common/patch_utils.py); its package needs torch_npu, so the real
    file is loaded by path. Idempotent; returns whether the fix is in place."""
    if COMPAT_MODULE in sys.modules:
        return True

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 6):
        return True
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch < 2.6 needs vLLM-Ascend's custom-op compat patch, but vllm_ascend is not "
                           "installed (see scripts/setup_test_env.sh)")
    path = os.path.join(spec.submodule_search_locations[0], "patch", "worker", "patch_common", "patch_utils.py")
    mod_spec = importlib.util.spec_from_file_location(COMPAT_MODULE, path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[COMPAT_MODULE] = module
    mod_spec.loader.exec_module(module)
    return True


def register() -> Optional[str]:
    """The plugin: the host platform's class on the CPU platform and the NPU rehearsal platform, else None."""
    # The NPU rehearsal platform generates with the CPU platform's stand-in too (its training side is the NPU's;
    # verl_patches/rigs/npu_rehearsal/records.py): vLLM runs as the host platform there, never vLLM-Ascend's.
    if accelerator.device_type() != "cpu" and not npu_rehearsal.selected():
        return None
    # vLLM swallows exceptions from platform plugins; a failure here would resurface later as an
    # unrelated-looking schema error, so it is reported where it happens.
    try:
        torch251_custom_op_compat()
    except Exception as e:  # noqa: BLE001
        print(f"verl_patches: vLLM's torch 2.5.1 custom-op fix failed: {e}", file=sys.stderr)
        raise
    return HOST_PLATFORM
