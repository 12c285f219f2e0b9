"""The address-stable region wrappers of a vLLM worker, shared by vLLM's GPU worker and vLLM-Ascend's
NPU worker (their load_model / initialize_from_config have the same shape): each hands the original
call to verl_patches.rollout.graph_safe, which decides whether the allocation goes into a region.
Imports nothing heavy, so the patch catalogue loads without torch (the doctor)."""

from __future__ import annotations

import functools
from typing import Any, Callable


# What the two worker patches (vLLM's GPU worker, vLLM-Ascend's NPU worker) say of themselves.
FLAG = ("actor_rollout_ref.rollout.enforce_eager=False with actor_rollout_ref.rollout.recipe.offload (default on); "
        "VERL_PATCHES_STABLE_MEMORY chooses the backend (auto | torch_memory_saver | vllm_cumem | none)")
WHY = ("The recipe releases the rollout weights and KV cache after every generation and allocates them again before "
       "the next; graphs captured at engine build read the old addresses, so both must live in an address-stable "
       "region from the first build (docs/DESIGN.md section 3, address stability).")
REMOVE_WHEN = ("vLLM (and vLLM-Ascend) can release and re-map the weights and the KV cache per tag at the same "
               "addresses without sleep mode's host copy, or the recipe's offload moves onto sleep mode.")


def wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self):
        # Lazy: graph_safe imports torch, and the catalogue loads this module (through the two worker patches)
        # without it.
        from verl_patches.rollout.graph_safe import worker_load_model

        return worker_load_model(self, lambda: original(self))

    return load_model


def wrap_initialize_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_from_config(self, kv_cache_config):
        # Lazy: graph_safe imports torch, and the catalogue loads this module (through the two worker patches)
        # without it.
        from verl_patches.rollout.graph_safe import worker_initialize_from_config

        return worker_initialize_from_config(self, lambda: original(self, kv_cache_config))

    return initialize_from_config
