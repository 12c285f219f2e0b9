"""The patch catalogue: one module per upstream module patched, grouped by upstream package.

Each listed module defines ``PATCHES``, a list of records; the registry reads them in this
order, which is also the order the prelude applies them in. The catalogue hands its modules to the
registry (verl_patches/core/registry.py), which names none itself: :func:`load_catalogue`.
"""

from __future__ import annotations

PATCH_MODULES: tuple[str, ...] = (
    # CPU platform stand-ins first (platforms=("cpu",)): what has no host implementation upstream.
    "verl_patches.patches.torch.patch_cuda",
    "verl_patches.patches.torch.patch_cuda_random",
    "verl_patches.patches.verl.patch_utils_device",
    "verl_patches.patches.verl.patch_utils_debug_performance",
    "verl_patches.patches.vllm.patch_model_executor_models_registry",
    "verl_patches.patches.verl.patch_models_mcore_model_initializer",
    "verl_patches.patches.megatron.patch_core_tensor_parallel_random",
    "verl_patches.patches.megatron.patch_core_fp8_utils",
    "verl_patches.patches.megatron.patch_core_transformer_moe_moe_utils",
    "verl_patches.patches.megatron.patch_core_transformer_moe_token_dispatcher",
    "verl_patches.patches.megatron.patch_core_transformer_moe_shared_experts",
    "verl_patches.patches.megatron.patch_core_pipeline_parallel_schedules",
    "verl_patches.patches.megatron.patch_core_optimizer",
    "verl_patches.patches.verl.patch_utils_reward_score",
    "verl_patches.patches.verl.patch_utils_model",
    "verl_patches.patches.verl.patch_utils_tracking",
    "verl_patches.patches.verl.patch_workers_rollout_vllm_rollout_spmd",
    "verl_patches.patches.verl.patch_trainer_ppo_core_algos",
    "verl_patches.patches.verl.patch_trainer_ppo_ray_trainer",
    "verl_patches.patches.verl.patch_workers_actor_megatron_actor",
    # megatron-core DDP overlap: the actor build hands the recipe keys to get_model; the update finishes the gather.
    "verl_patches.patches.verl.patch_workers_megatron_workers_ddp_overlap",
    "verl_patches.patches.verl.patch_utils_megatron_utils_ddp_overlap",
    "verl_patches.patches.verl.patch_workers_actor_megatron_actor_ddp_overlap",
    # verl's Megatron worker, one module per feature (wrappers of one method in declared order).
    "verl_patches.patches.verl.patch_workers_megatron_workers_tensor_cache",
    "verl_patches.patches.verl.patch_workers_megatron_workers_model_layout",
    "verl_patches.patches.verl.patch_workers_megatron_workers_switch",
    "verl_patches.patches.verl.patch_workers_megatron_workers_checkpoint",
    "verl_patches.patches.verl.patch_workers_megatron_workers_rollout_compile",
    # The run's self-checks (after the wrappers of the methods they wrap too).
    "verl_patches.patches.verl.patch_trainer_ppo_ray_trainer_self_check",
    "verl_patches.patches.verl.patch_workers_megatron_workers_self_check",
    "verl_patches.patches.verl.patch_workers_sharding_manager_megatron_vllm",
    "verl_patches.patches.vllm.patch_distributed_parallel_state",
    "verl_patches.patches.vllm.patch_config",
    "verl_patches.patches.vllm.patch_forward_context",
    "verl_patches.patches.vllm.patch_v1_engine_core",
    "verl_patches.patches.vllm.patch_entrypoints_llm",
    "verl_patches.patches.vllm.patch_v1_worker_gpu_worker",
    "verl_patches.patches.vllm.patch_model_executor_layers_fused_moe_layer",
    "verl_patches.patches.vllm_ascend.patch_worker_model_runner_v1",
    "verl_patches.patches.vllm_ascend.patch_worker_worker_v1",
    "verl_patches.patches.vllm_ascend.patch_ops_fused_moe",
    "verl_patches.patches.verl.patch_models_mcore_registry",
    "verl_patches.patches.verl.patch_single_controller_base_megatron_worker",
    "verl_patches.patches.verl.patch_utils_megatron_utils",
    "verl_patches.patches.verl.patch_utils_megatron_utils_switch",
    "verl_patches.patches.megatron.patch_core_transformer_transformer_block",
    "verl_patches.patches.megatron.patch_core_transformer_transformer_layer",
    "verl_patches.patches.megatron.patch_core_transformer_moe_router",
    "verl_patches.patches.megatron.patch_core_optimizer_distrib_optimizer",
    "verl_patches.patches.mindspeed.patch_arguments",
)


def load_catalogue() -> list:
    """Every patch record of the catalogue, plus the modules named by VERL_PATCHES_EXTRA_MODULES (a site's
    own patches; tests use it for fixtures), checked by the registry."""
    from verl_patches import env
    from verl_patches.core.registry import load_registry

    return load_registry(PATCH_MODULES + env.get("VERL_PATCHES_EXTRA_MODULES"))


def get_patch(patch_id: str):
    """The catalogue's record ``patch_id`` (KeyError if there is none)."""
    from verl_patches.core.registry import find_patch

    return find_patch(load_catalogue(), patch_id)
