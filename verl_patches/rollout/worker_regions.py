"""The address-stable region wrappers of a vLLM worker, shared by vLLM's GPU worker and vLLM-Ascend's
NPU worker (their load_model / initialize_from_config have the same shape): each hands the original
call to verl_patches.rollout.graph_safe, which decides whether the allocation goes into a region.
Imports nothing heavy, so the patch catalogue loads without torch (the doctor)."""

from __future__ import annotations

import functools
from typing import Any, Callable


def wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self):
        from verl_patches.rollout.graph_safe import worker_load_model

        return worker_load_model(self, lambda: original(self))

    return load_model


def wrap_initialize_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_from_config(self, kv_cache_config):
        from verl_patches.rollout.graph_safe import worker_initialize_from_config

        return worker_initialize_from_config(self, lambda: original(self, kv_cache_config))

    return initialize_from_config
