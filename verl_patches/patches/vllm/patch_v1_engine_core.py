"""vLLM 0.9.1's v1 engine core keeps its per-worker KV-cache configs, so the cache can be re-created.

Upstream: vllm/v1/engine/core.py:EngineCore._initialize_kv_caches profiles memory, derives one
KVCacheConfig per worker, hands them to model_executor.initialize_from_config and returns only
the first one (for the scheduler); the per-worker list is dropped. We wrap it: the original
runs unchanged, and the list it handed to the executor is kept on the engine core
(verl_patches.rollout.kv_cache.KEPT_ATTR). verl_patches.rollout.kv_cache then frees the cache
after generation and re-creates the same cache (same block count, so the scheduler's block
pool stays valid) before the next one, without profiling again.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def wrap_initialize_kv_caches(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _initialize_kv_caches(self, vllm_config):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.rollout.kv_cache import KEPT_ATTR

        executor = self.model_executor
        handed: list = []
        upstream_init = executor.initialize_from_config

        def initialize_from_config(kv_cache_configs):
            handed.append(list(kv_cache_configs))
            return upstream_init(kv_cache_configs)

        # Seen for the length of the original call only: an instance attribute shadows the
        # executor's method, and deleting it restores the class's.
        shadowed = "initialize_from_config" in vars(executor)
        executor.initialize_from_config = initialize_from_config
        try:
            result = original(self, vllm_config)
        finally:
            if shadowed:
                executor.initialize_from_config = upstream_init
            else:
                del executor.initialize_from_config
        if len(handed) != 1:
            raise RuntimeError(f"EngineCore._initialize_kv_caches handed the executor {len(handed)} KV-cache config "
                               "lists, expected 1: vLLM changed how it initialises the cache")
        setattr(self, KEPT_ATTR, handed[0])
        return result

    return _initialize_kv_caches


PATCHES = [
    Patch(
        feature="switch",
        id="vllm.engine_core.keep_kv_cache_configs",
        target="vllm.v1.engine.core:EngineCore._initialize_kv_caches",
        kind="wrap",
        phases=("worker", "engine_core"),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(
            signature="def _initialize_kv_caches(self, vllm_config: VllmConfig) -> tuple[int, int, KVCacheConfig]",
            source_sha="4c8b1fcc34626912",
        ),
        replacement=f"{__name__}:wrap_initialize_kv_caches",
        flag="actor_rollout_ref.rollout.recipe.offload (default True: the rollout frees and re-creates the cache "
             "each step; keeping the configs costs nothing when it does not)",
        why="The rollout shares every die with training, so the KV cache must be freed after generation and "
            "re-created before the next one; vLLM's sleep mode does not free it on multi-node NPU, and vLLM 0.9.1 "
            "drops the per-worker KV-cache configs needed to re-create it (docs/RECIPE.md item 8).",
        remove_when="vLLM keeps the KV-cache configs on the engine (or offers a free / re-initialise KV cache API "
                    "that releases device memory on every platform).",
    ),
]
