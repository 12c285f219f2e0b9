"""Make the real upstream stack importable in the CPU test environment (no NPU, no CUDA).

Only for tests and local tools: on the cluster vLLM-Ascend's own platform plugin does this.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

_COMPAT_MODULE = "_vllm_ascend_torch251_custom_op_compat"


def prepare_cpu_upstream() -> None:
    """Idempotent. Call before importing vLLM model code in a CPU process.

    1. VLLM_PLUGINS: vLLM-Ascend registers a platform plugin that imports torch_npu;
       only our own plugin may load here.
    2. torch 2.5.1 cannot infer custom-op schemas from PEP 585 annotations (list[int]),
       which vLLM 0.9.1 uses (it is built for torch 2.7). vLLM-Ascend ships the fix in
       vllm_ascend/patch/worker/patch_common/patch_utils.py, applied on Ascend by its
       plugin; its package __init__ needs torch_npu, so the real file is loaded by path.
    """
    os.environ.setdefault("VLLM_PLUGINS", "verl_patches")
    if _COMPAT_MODULE in sys.modules:
        return
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 6):
        return
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch < 2.6 needs vLLM-Ascend's custom-op compat patch, "
                           "but vllm_ascend is not installed (see scripts/setup_test_env.sh)")
    path = os.path.join(spec.submodule_search_locations[0], "patch", "worker", "patch_common",
                        "patch_utils.py")
    mod_spec = importlib.util.spec_from_file_location(_COMPAT_MODULE, path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[_COMPAT_MODULE] = module
    mod_spec.loader.exec_module(module)
