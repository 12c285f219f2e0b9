"""The rollout engine's memory actions: onload / offload weights, init / free KV cache, on the offload engine.

One in-process vLLM engine per rollout worker. Weights are a TensorGroup (storages resized to
zero and back, so vLLM's parameters keep their identity); the KV cache is a CallbackGroup whose
owner is vLLM (verl_patches.rollout.kv_cache frees and re-creates it from the kept configs).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

from verl_patches.offload import CallbackGroup, Location, OffloadEngine, rollout_weights_group
from verl_patches.rollout import kv_cache

logger = logging.getLogger(__name__)


_SHARED: Optional[OffloadEngine] = None


def shared_offload_engine() -> OffloadEngine:
    """The process's one OffloadEngine: the rollout's groups and the training groups share its
    host pool and its storage registry (one storage, one owner, one host copy)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = OffloadEngine()
    return _SHARED


class RolloutMemoryActions(Protocol):
    """What the switch schedule calls on a rollout (docs/RECIPE.md item 2): each is idempotent."""

    def onload_model_weights(self) -> int: ...

    def offload_model_weights(self) -> int: ...

    def init_cache_engine(self) -> int: ...

    def free_cache_engine(self) -> int: ...


def _model_of(worker: Any) -> Any:
    return worker.model_runner.model


def _kv_tensors_of(worker: Any) -> list:
    return list(kv_cache._tensors(worker.model_runner.kv_caches))


class VllmEngineMemory:
    """RolloutMemoryActions for a ``vllm.LLM`` built in-process, backed by the offload engine.

    ``keep_weights_on_host``: offload copies the weights to host and onload copies them back.
    Off (the recipe), offload only frees them and onload allocates empty storage: the reshard
    writes every rollout weight after each update, so a host copy would be moved for nothing.
    """

    def __init__(self, llm: Any, engine: Optional[OffloadEngine] = None, *, keep_weights_on_host: bool = False,
                 name: str = "rollout") -> None:
        self.core = kv_cache.engine_core_of(llm)
        self.engine = engine or shared_offload_engine()
        self.keep_weights_on_host = keep_weights_on_host
        executor = self.core.model_executor
        (model,) = executor.collective_rpc(_model_of)  # one worker per engine in verl's SPMD layout
        # Parameters only: the reshard rewrites every one of them after each update. Buffers
        # (rotary caches and the like) are computed once at build time and nothing rewrites
        # them, so freeing them without a copy would bring back garbage; they are small.
        params = list(model.parameters())
        self._model = model
        self.weights = rollout_weights_group(self.engine, params, name=f"{name}_weights")
        self._closed = False
        # Graphs captured at build time (CUDA graphs; TorchAir with vLLM-Ascend's
        # frozen_parameter=True) read weights at the addresses they had then. Storage that
        # comes back elsewhere is reported after every onload (see moved_parameters).
        self._params = params
        self._built_at = [p.data_ptr() for p in params]
        self._graph_mode = not bool(getattr(self.core.vllm_config.model_config, "enforce_eager", True))
        self.kv = CallbackGroup(f"{name}_kv_cache", allocate_fn=self._allocate_kv, release_fn=self._release_kv)
        # vLLM allocated the cache while building the engine; a CallbackGroup starts released,
        # so free it now: the first init_cache_engine re-creates it (before the first generation).
        kv_cache.free_kv_cache(self.core)

    def close(self) -> None:
        """Give the weights' host buffer and storage claims back to the offload engine (engine rebuilt)."""
        if not self._closed:
            self.weights.close()
            self._closed = True

    def groups(self) -> dict:
        """The groups under the switch schedule's role names (verl_patches.offload.schedule.ROLES)."""
        return {"rollout_weights": self.weights, "kv_cache": self.kv}

    def _allocate_kv(self) -> list:
        kv_cache.init_kv_cache(self.core)
        return [t for ts in self.core.model_executor.collective_rpc(_kv_tensors_of) for t in ts]

    def _release_kv(self) -> None:
        kv_cache.free_kv_cache(self.core)

    def moved_parameters(self) -> int:
        """How many resident parameters are no longer at the address the engine was built with."""
        return sum(1 for p, at in zip(self._params, self._built_at)
                   if p.untyped_storage().nbytes() and p.data_ptr() != at)

    def onload_model_weights(self) -> int:
        if self.weights.location is Location.HOST:
            moved = self.weights.onload()
        else:
            moved = self.weights.allocate()
        if self._graph_mode:
            n = self.moved_parameters()
            if n:
                logger.warning("%d of %d rollout parameters came back at a different device address than the "
                               "captured graphs use (enforce_eager=False); graph replays may read stale memory. "
                               "Verify generations, or run the rollout with enforce_eager=True.", n,
                               len(self._params))
        return moved

    def offload_model_weights(self) -> int:
        if self.keep_weights_on_host:
            return self.weights.offload()
        # MLA's derived tensors go with the weights; the sharding manager recomputes them after
        # the next reshard (patch verl.sharding_manager.reshard).
        from verl_patches.rollout.mla import release_mla_derived

        return self.weights.release() + release_mla_derived(self._model)

    def init_cache_engine(self) -> int:
        return self.kv.allocate()

    def free_cache_engine(self) -> int:
        return self.kv.release()
