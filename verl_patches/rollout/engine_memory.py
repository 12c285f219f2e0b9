"""The rollout engine's memory: its weights and KV cache as groups on the process's offload engine.

One in-process vLLM engine per rollout worker. Eager mode: weights are a TensorGroup (storages
resized to zero and back, so vLLM's parameters keep their identity); the KV cache is a
CallbackGroup whose owner is vLLM (verl_patches.rollout.kv_cache frees and re-creates it from the
kept configs). Graph mode: the engine was built inside address-stable regions
(verl_patches.rollout.graph_safe); weights (with MLA's derived tensors) and KV cache are
TensorGroups over those regions, released and mapped again at the same addresses. The groups move
only under the process's switch loop (verl_patches/offload/live.py), which owns the offload engine.
"""

from __future__ import annotations

from typing import Any, Optional

from verl_patches.offload import (CallbackGroup, HookedGroup, OffloadEngine, OffloadGroup, kv_cache_group,
                                  rollout_weights_group)
from verl_patches.core import stash
from verl_patches.rollout import kv_cache
from verl_patches.offload.live import live_switch
from verl_patches.rollout.graph_safe import BUILD_ATTR, PATCH_IDS, GraphModeError
from verl_patches.rollout.mla import release_mla_derived



def attach_engine_memory(llm: Any, memory: Any) -> None:
    """Put a recipe engine's memory (VllmEngineMemory) under the process's switch loop and route
    the engine's sleep / wake_up to it. The loop starts where an update ends, so its weights and
    KV cache are released now: what upstream's build-time sleep would do."""
    live_switch().attach(memory)
    # Where the sleep / wake_up wrappers (patch vllm.llm.*) find it.
    stash.put(llm, "memory", memory)


def _model_of(worker: Any) -> Any:
    return worker.model_runner.model


def _kv_tensors_of(worker: Any) -> list:
    return list(kv_cache._tensors(worker.model_runner.kv_caches))


def _stable_build_of(worker: Any) -> Any:
    return getattr(worker, BUILD_ATTR, None)


def _worker_of(worker: Any) -> Any:
    return worker


class VllmEngineMemory:
    """The memory of a ``vllm.LLM`` built in-process, on the switch loop's offload engine.

    The weights are never copied: after each update the reshard writes every rollout weight, so
    releasing them frees memory and allocating gives empty storage for the reshard to fill. The
    groups carry the engine's side effects (HookedGroup), so the switch loop
    (verl_patches.offload.live), which moves them by role, runs them.
    """

    def __init__(self, llm: Any, engine: Optional[OffloadEngine] = None, *, name: str = "rollout") -> None:
        self.core = kv_cache.engine_core_of(llm)
        if engine is None:
            engine = live_switch().offload_engine()
        self.engine = engine
        executor = self.core.model_executor
        (model,) = executor.collective_rpc(_model_of)  # one worker per engine in verl's SPMD layout
        (self.stable,) = executor.collective_rpc(_stable_build_of)
        self._model = model
        self._closed = False
        # Graphs captured at build time (CUDA graphs; TorchAir with vLLM-Ascend's
        # frozen_parameter=True) read weights, MLA's derived tensors and the KV cache at the
        # addresses they had then: in graph mode all of them must stay there.
        self._graph_mode = not bool(getattr(self.core.vllm_config.model_config, "enforce_eager", True))
        if self._graph_mode and self.stable is None:
            raise GraphModeError("the rollout engine runs graphs (enforce_eager=False) but was not built inside "
                                 "address-stable regions: call verl_patches.rollout.graph_safe.arm_for_build before "
                                 f"building it, with patch {' / '.join(PATCH_IDS)} applied; or set enforce_eager=True")
        self.weights: OffloadGroup
        self.kv: OffloadGroup
        if self.stable is None:
            # Parameters only: the reshard rewrites every one of them after each update. Buffers
            # (rotary caches and the like) are computed once at build time and nothing rewrites
            # them, so freeing them without a copy would bring back garbage; they are small.
            # MLA's derived tensors go with the weights; the sharding manager recomputes them after
            # the next reshard (patch verl.sharding_manager.reshard).
            self.weights = HookedGroup(
                rollout_weights_group(self.engine, list(model.parameters()), name=f"{name}_weights"),
                before={"release": lambda: release_mla_derived(self._model)})
            self.kv = CallbackGroup(f"{name}_kv_cache", allocate_fn=self._allocate_kv, release_fn=self._release_kv)
            # vLLM allocated the cache while building the engine; a CallbackGroup starts released,
            # so free it now: the loop's init_kv_cache re-creates it (before the first generation).
            kv_cache.free_kv_cache(self.core)
        else:
            self._build_stable_groups(name)

    def close(self) -> None:
        """Give the weights' host buffer and storage claims back to the offload engine (engine rebuilt)."""
        if not self._closed:
            live_switch().detach(self)
            self.weights.close()
            self.kv.close()  # a TensorGroup in graph mode (its name and storages are claimed too)
            self._closed = True

    def groups(self) -> dict:
        """The groups under the switch schedule's role names (verl_patches.offload.schedule.ROLES)."""
        return {"rollout_weights": self.weights, "kv_cache": self.kv}

    def addresses_checked(self) -> int:
        """Captured-graph addresses the groups compared so far, after every allocate (graph mode;
        0 in eager mode, where nothing is captured)."""
        return int(self.weights.addresses_checked) + int(self.kv.addresses_checked) if self.stable is not None else 0

    def _allocate_kv(self) -> list:
        kv_cache.init_kv_cache(self.core)
        return [t for ts in self.core.model_executor.collective_rpc(_kv_tensors_of) for t in ts]

    def _release_kv(self) -> None:
        kv_cache.free_kv_cache(self.core)

    def _build_stable_groups(self, name: str) -> None:
        build = self.stable
        # Parameters and MLA's derived tensors, which stay in the region and are rewritten in
        # place (the reshard writes the parameters, redo_mla_post_load copies into the derived).
        self.weights = rollout_weights_group(self.engine, list(build.weight_tensors(self._model).values()),
                                             name=f"{name}_weights", region=build.weights,
                                             watch=lambda: build.weight_tensors(self._model))
        (worker,) = self.core.model_executor.collective_rpc(_worker_of)
        runner = worker.model_runner
        watch = build.kv_watch(lambda: runner.kv_caches,
                               lambda: worker.vllm_config.compilation_config.static_forward_context)
        # Zeroed on allocate: what a fresh initialize_from_config gives (torch.zeros).
        kv = kv_cache_group(self.engine, list(build.kv_tensors), name=f"{name}_kv_cache", region=build.kv,
                            watch=watch, zero_on_allocate=True)
        # Before the KV cache comes back, the last point before generation: the reshard and the MLA
        # redo ran since the weights were mapped, and must have written in place. Before it is freed:
        # cached prefixes point into blocks whose contents the release loses.
        self.kv = HookedGroup(kv, before={"allocate": self.weights.check_addresses,
                                          "release": lambda: kv_cache.reset_prefix_cache(self.core)})
        self.kv.release()
