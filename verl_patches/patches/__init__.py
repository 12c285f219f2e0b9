"""The patch catalogue: one module per upstream module patched, grouped by upstream package.

Each listed module defines ``PATCHES``, a list of records. The recipe's own patches come first
(``RECIPE_MODULES``, one folder per upstream package: megatron/, verl/, vllm/, vllm_ascend/,
mindspeed/), then the CPU platform's (``CPU_MODULES``, in the rig wing, rigs/cpu/patches/: stand-ins so the
loop runs on a host, applied only there; named here by string, so the catalogue imports no rig). The registry
reads them in that order (``PATCH_MODULES``) and checks each record's ``requires`` / ``after`` in it; the
prelude applies the CPU platform's first, each group in its own order (:func:`in_application_order`). The
catalogue hands its modules to the registry (verl_patches/core/registry.py), which names none itself:
:func:`load_catalogue`.
"""

from __future__ import annotations

from verl_patches.base import env
from verl_patches.core.registry import check_catalogue, load_registry, find_patch

RECIPE_MODULES: tuple[str, ...] = (
    "verl_patches.patches.verl.patch_utils_reward_score",
    "verl_patches.patches.verl.patch_utils_model",
    "verl_patches.patches.verl.patch_utils_tracking",
    "verl_patches.patches.verl.patch_workers_rollout_vllm_rollout_spmd",
    "verl_patches.patches.verl.patch_trainer_ppo_core_algos",
    "verl_patches.patches.verl.patch_trainer_ppo_ray_trainer",
    "verl_patches.patches.verl.patch_trainer_ppo_ray_trainer_checkpoint",
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
    "verl_patches.patches.verl.patch_models_mcore_model_initializer",
    "verl_patches.patches.verl.patch_single_controller_base_megatron_worker",
    "verl_patches.patches.verl.patch_utils_megatron_utils",
    "verl_patches.patches.verl.patch_utils_megatron_utils_switch",
    "verl_patches.patches.megatron.patch_core_transformer_transformer_block",
    "verl_patches.patches.megatron.patch_core_transformer_transformer_layer",
    "verl_patches.patches.megatron.patch_core_transformer_moe_router",
    "verl_patches.patches.megatron.patch_core_optimizer_distrib_optimizer",
    "verl_patches.patches.megatron.patch_core_jit",
    "verl_patches.patches.megatron.patch_core_models_common_embeddings_rope_utils",
    "verl_patches.patches.mindspeed.patch_arguments",
    "verl_patches.patches.mindspeed.patch_features_manager_features_manager",
    "verl_patches.patches.mindspeed.patch_core_megatron_basic_requirements_basic",
    "verl_patches.patches.mindspeed.patch_llm_core_transformer_custom_dot_product_attention",
)

# The CPU platform (platforms=("cpu",) only): what has no host implementation upstream.
CPU_PACKAGE = "verl_patches.rigs.cpu.patches"
CPU_MODULES: tuple[str, ...] = (
    f"{CPU_PACKAGE}.torch.patch_cuda",
    f"{CPU_PACKAGE}.torch.patch_cuda_random",
    f"{CPU_PACKAGE}.verl.patch_utils_device",
    f"{CPU_PACKAGE}.verl.patch_utils_debug_performance",
    f"{CPU_PACKAGE}.vllm.patch_model_executor_models_registry",
    f"{CPU_PACKAGE}.verl.patch_models_mcore_model_initializer",
    f"{CPU_PACKAGE}.megatron.patch_core_tensor_parallel_random",
    f"{CPU_PACKAGE}.megatron.patch_core_fp8_utils",
    f"{CPU_PACKAGE}.megatron.patch_core_transformer_moe_moe_utils",
    f"{CPU_PACKAGE}.megatron.patch_core_transformer_moe_token_dispatcher",
    f"{CPU_PACKAGE}.megatron.patch_core_transformer_moe_shared_experts",
    f"{CPU_PACKAGE}.megatron.patch_core_pipeline_parallel_schedules",
    f"{CPU_PACKAGE}.megatron.patch_core_optimizer",
    f"{CPU_PACKAGE}.vllm.patch_entrypoints_llm",
)

PATCH_MODULES: tuple[str, ...] = RECIPE_MODULES + CPU_MODULES


def in_application_order(patches: list) -> list:
    """``patches`` (catalogue order) in the order the prelude applies them: the CPU platform's first
    (its stand-ins are in place before anything runs through torch.cuda, verl's device helpers or
    Megatron's RNG tracker), then every other record; each group keeps its catalogue order."""
    def is_cpu(p) -> bool:
        return p.replacement.startswith(CPU_PACKAGE + ".")

    return [p for p in patches if is_cpu(p)] + [p for p in patches if not is_cpu(p)]


def load_catalogue() -> list:
    """Every patch record of the catalogue, plus the modules named by VERL_PATCHES_EXTRA_MODULES (a site's
    own patches; tests use it for fixtures), checked by the registry."""
    records = load_registry(PATCH_MODULES + env.get("VERL_PATCHES_EXTRA_MODULES"))
    check_catalogue(in_application_order(records))  # requires / after hold in the order they are applied in too
    return records


def get_patch(patch_id: str):
    """The catalogue's record ``patch_id`` (KeyError if there is none)."""
    return find_patch(load_catalogue(), patch_id)
