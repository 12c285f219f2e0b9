"""Attributes the overlay hangs on upstream objects (vLLM's LLM, verl's workers and sharding
manager, Megatron's TransformerConfig, ...): one naming convention, ``_verl_patches_<key>``, and one
table of keys, so that a typo is an error instead of a silent ``None``."""

from __future__ import annotations

from typing import Any

PREFIX = "_verl_patches_"
# key -> what it holds and on which object
KEYS: dict[str, str] = {
    "rollout_settings": "the rollout's RolloutSettings (the run's RecipeSettings within), on vLLM's LLM (read by "
                        "the sharding manager and the generation)",
    "memory": "the rollout's offload-engine memory, on vLLM's LLM (sleep / wake_up route to it)",
    "reshard": "the reshard session (plan, binding), on verl's sharding manager",
    "moved_reported": "bytes moved already reported by the switch metrics, on the actor's memory",
    "mem_reported": "the last ledger entry whose device watermarks the switch metrics sent, on the switch's ledger",
    "mem_known": "the latest device watermarks per switch step, on the live switch",
    "report": "the per-step RunReport, on verl's Tracking",
    "stable_build": "the address-stable region build, on the vLLM worker",
    "kv_cache_configs": "the KV cache configs kept for re-initialisation, on vLLM's engine core",
    "local_call": "marks a replacement of a worker-group call that never calls the workers",
    "num_layer_list": "the recipe's uneven pipeline layer list, on Megatron's TransformerConfig",
    "actor_memory": "the actor's offload groups (ActorMemory), on verl's worker and its sharding manager",
    "ref_memory": "the reference's offload group (ReferenceMemory), on verl's worker",
    "engine_memory": "the rollout engine's offload groups (VllmEngineMemory), on verl's vLLMRollout",
    "step": "the trainer's global step of the generation under way, on verl's sharding manager",
    "addresses_reported": "captured-graph addresses checked already reported, on verl's sharding manager",
    "update_probe": "the next update's rollout-mismatch / entropy probe (UpdateProbe), on verl's MegatronPPOActor",
    "timing": "verl's sharding manager's timing dict of the generation under way, on vLLM's LLM (the "
              "generation adds its rollout/... figures)",
}


# Not an attribute but a key of verl's DataProto.meta_info: the trainer's global step on a generation request
# (set by patch verl.ray_trainer.self_check's wrapper, read by the worker's, patch verl.megatron_workers.self_check).
STEP_META_KEY = "verl_patches.global_step"


class StashKeyError(KeyError):
    pass


def attr(key: str) -> str:
    """The attribute name of ``key``."""
    if key not in KEYS:
        raise StashKeyError(f"no stash key {key!r} (verl_patches/core/stash.py: {sorted(KEYS)})")
    return PREFIX + key


def put(obj: Any, key: str, value: Any) -> None:
    setattr(obj, attr(key), value)


def get(obj: Any, key: str, default: Any = None) -> Any:
    return getattr(obj, attr(key), default)
