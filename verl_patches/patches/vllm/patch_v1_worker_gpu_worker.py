"""vLLM's GPU worker builds the rollout weights and KV cache inside address-stable regions in graph mode.

Upstream: vllm/v1/worker/gpu_worker.py:Worker.load_model and Worker.initialize_from_config
allocate the weights and the KV cache through the caching allocator, or, with sleep mode on,
inside vLLM's CuMemAllocator pool (tags "weights" and "kv_cache"). The recipe turns sleep mode off
and releases both every step through its offload engine; CUDA graphs captured after these two
calls read the addresses they had then. We wrap both: when the rollout constructor armed a
graph-safe build (verl_patches.rollout.graph_safe.arm_for_build: enforce_eager=False with
recipe.offload), the original runs inside the backend's weights region, then inside its KV-cache
region, before any graph is captured; load_model's other tensors (rotary caches, expert maps)
are moved out of the weights region, and the result is left on the worker for
verl_patches.rollout.engine_memory. Unarmed (eager mode, vLLM's own sleep mode) the original runs.
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
        id="vllm.worker.stable_regions",
        target="vllm.v1.worker.gpu_worker:Worker.load_model",
        kind="wrap",
        phases=("worker",),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(signature="def load_model(self) -> None", source_sha="12bce57dcdbd0068"),
        replacement=f"{__name__}:wrap_load_model",
        flag=FLAG,
        why=WHY,
        remove_when=REMOVE_WHEN,
        platforms=("cuda",),
    ),
    Patch(
        feature="graph_safe_switch",
        id="vllm.worker.stable_kv_cache_region",
        target="vllm.v1.worker.gpu_worker:Worker.initialize_from_config",
        kind="wrap",
        phases=("worker",),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(signature="def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None",
                                source_sha="cf3b8c3259669876"),
        replacement=f"{__name__}:wrap_initialize_from_config",
        flag=FLAG,
        why=WHY,
        remove_when=REMOVE_WHEN,
        platforms=("cuda",),
    ),
]
