"""Free vLLM's KV cache after generation and re-create it before the next, every training step.

vLLM 0.9.1 sizes and allocates the cache once (EngineCore._initialize_kv_caches) and offers
only sleep mode to give the memory back, which does not free it on multi-node NPU. With the
per-worker KV-cache configs kept (patch vllm.engine_core.keep_kv_cache_configs) the same cache
is re-created through the worker's own initialize_from_config; freeing drops every reference.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_patches.core import stash
from verl_patches.base import accelerator

PATCH_ID = "vllm.engine_core.keep_kv_cache_configs"
# Where the patch keeps the per-worker KVCacheConfig list on the EngineCore instance.
KEPT_ATTR = stash.attr("kv_cache_configs")


class KVCacheError(RuntimeError):
    """The KV cache cannot be freed or re-created in the engine's current state."""


def engine_core_of(llm: Any) -> Any:
    """The in-process v1 EngineCore behind a ``vllm.LLM`` (verl's SPMD rollout runs it in-process)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(client, "engine_core", None)
    if core is None or not hasattr(core, "model_executor"):
        raise KVCacheError(f"no in-process EngineCore behind {type(llm).__name__}: the KV cache can be re-created "
                           "only with vLLM's V1 engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, which the "
                           "external launcher sets)")
    return core


def kept_configs(engine_core: Any) -> list:
    configs = getattr(engine_core, KEPT_ATTR, None)
    if not configs:
        raise KVCacheError(f"the engine core kept no KV-cache configs: patch {PATCH_ID!r} was not applied when the "
                           "engine was built, so the cache could not be re-created after freeing it")
    return configs


def free_kv_cache(engine_core: Any) -> int:
    """Drop the KV cache on every worker; return the device bytes released (as the workers count them)."""
    kept_configs(engine_core)  # refuse before freeing: a freed cache with no way back is worse
    reset_prefix_cache(engine_core)
    freed = engine_core.model_executor.collective_rpc(release_worker_kv_cache)
    accelerator.empty_cache()
    return int(sum(freed))


def reset_prefix_cache(engine_core: Any) -> None:
    """Forget every cached prefix before the cache's contents go: they point into blocks whose contents
    die with the release (and the weights change before the next generation anyway)."""
    # False means a request still holds blocks.
    if not engine_core.scheduler.reset_prefix_cache():
        raise KVCacheError("cannot free the KV cache while requests still hold KV blocks (generation not finished)")


def init_kv_cache(engine_core: Any) -> None:
    """Re-create the cache on every worker with the configs it was first built with.

    Only the allocation and binding run (the worker's initialize_from_config); the model is not
    compiled or warmed up again. Eager mode only: the new cache lands at new addresses, so in
    graph mode the cache is instead released and mapped again in place (verl_patches.rollout.graph_safe).
    """
    configs = kept_configs(engine_core)
    engine_core.model_executor.collective_rpc("initialize_from_config", args=(configs,))


def release_worker_kv_cache(worker: Any) -> int:
    """On a worker: unbind the cache from the model runner and every attention layer."""
    runner = worker.model_runner
    seen: dict[int, int] = {}
    for t in _tensors(runner.kv_caches):
        seen[id(t.untyped_storage())] = int(t.untyped_storage().nbytes())
    # Clear in place: bind_kv_cache refills this same list, which compiled graphs may hold.
    runner.kv_caches.clear()
    for layer in worker.vllm_config.compilation_config.static_forward_context.values():
        cache = getattr(layer, "kv_cache", None)
        if isinstance(cache, list):
            layer.kv_cache = [torch.tensor([]) for _ in cache]
    return sum(seen.values())


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
