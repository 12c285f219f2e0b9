"""vLLM-Ascend's NPU worker builds the rollout weights and KV cache inside address-stable regions in graph mode.

Upstream: vllm_ascend/worker/worker_v1.py:NPUWorker.load_model and NPUWorker.initialize_from_config,
the NPU twins of vLLM's GPU worker methods (with sleep mode on they use CaMemAllocator's pool,
tags "weights" and "kv_cache"). TorchAir graphs with frozen_parameter, compiled after these two
calls, read the addresses the weights and the cache had then. Wrapped exactly as the GPU worker
(verl_patches.patches.vllm.patch_v1_worker_gpu_worker; the wrappers, and what both patches say of
themselves, are in verl_patches.rollout.worker_regions): in an armed graph-safe build both run inside
CaMemAllocator regions of our own tags. The module needs torch_npu to import, so these patches are
applied on Ascend only.
"""

from __future__ import annotations


from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.rollout import worker_regions
from verl_patches.rollout.worker_regions import FLAG, REMOVE_WHEN, WHY


# The wrappers are shared with the other accelerator's worker (same method shapes).
wrap_load_model = worker_regions.wrap_load_model
wrap_initialize_from_config = worker_regions.wrap_initialize_from_config


PATCHES = [
    Patch(
        feature="graph_safe_switch",
        id="vllm_ascend.worker.stable_regions",
        target="vllm_ascend.worker.worker_v1:NPUWorker.load_model",
        kind="wrap",
        phases=("worker",),
        upstream="vllm_ascend",
        versions="==0.9.1",
        fingerprint=Fingerprint(signature="def load_model(self) -> None", source_sha="029d83e0026ed599"),
        replacement=f"{__name__}:wrap_load_model",
        flag=FLAG,
        why=WHY,
        remove_when=REMOVE_WHEN,
        platforms=("npu",),
    ),
    Patch(
        feature="graph_safe_switch",
        id="vllm_ascend.worker.stable_kv_cache_region",
        target="vllm_ascend.worker.worker_v1:NPUWorker.initialize_from_config",
        kind="wrap",
        phases=("worker",),
        upstream="vllm_ascend",
        versions="==0.9.1",
        fingerprint=Fingerprint(signature="def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None",
                                source_sha="2614660b79fee6eb"),
        replacement=f"{__name__}:wrap_initialize_from_config",
        flag=FLAG,
        why=WHY,
        remove_when=REMOVE_WHEN,
        platforms=("npu",),
    ),
]
