"""recipe.megatron reaches Megatron and MindSpeed where verl builds the TransformerConfig.

Upstream: verl/single_controller/base/megatron/worker.py:MegatronWorker._init_hf_config_and_tf_config,
which the actor / reference build calls once, after the parallel groups exist and before any
model or optimizer is built. We wrap it (only when the worker's config has
rollout.recipe.megatron, i.e. ActorRolloutRefWorker):
- before: parse the section (verl_patches.config.megatron_args); set recipe.fixed_routing for the router
  patches (verl_patches/train/fixed_routing.py); refuse uneven stages together with verl's
  HF-weight loader or HF saver (both assume equal stages); merge the values TransformerConfig has
  a field for under the user's override_transformer_config; on Ascend hand MindSpeed its
  arguments (moe_tp_extend_ep, swap_optimizer, use_flash_attn, use_fused_rotary_pos_emb,
  use_fused_swiglu, num_layer_list) before MindSpeed's adaptor parses them and registers its
  feature patches (the NPU-only patch in patches/mindspeed/patch_arguments.py supplies them as
  parser defaults, so an explicit command-line flag still wins);
- after: check the list against the model's layer count and the PP / VPP / expert-TP layout,
  and attach it to the TransformerConfig, where the megatron and verl offset patches read it.
Off Ascend there is no MindSpeed: moe_tp_extend_ep is refused (it changes where experts live),
and the MindSpeed-only kernels are reported as not used.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.config import megatron_args as ma
from verl_patches.config.megatron_args import set_pending_mindspeed_args, SECTION, RecipeMegatronError, is_uneven
from verl_patches.train.layer_list import LAYER_LIST_ATTR
from verl_patches.train.mindspeed_adaptor import build_global_args

logger = logging.getLogger(__name__)
SECTION_IN_WORKER = "rollout.recipe.megatron"  # the worker's config is actor_rollout_ref
_MINDSPEED_ONLY = ("swap_optimizer", "use_flash_attn", "use_fused_rotary_pos_emb", "use_fused_rmsnorm",
                   "moe_permutation_async_comm", "moe_alltoall_overlap_comm",
                   "use_fused_moe_token_permute_and_unpermute", "gemm_gradient_accumulation_fusion")
# The MindSpeed arguments this process imported MindSpeed's adaptor with (the actor and the
# reference both pass through the binding; the second time is not a late import).
_IMPORTED_BY_US: dict[str, Any] | None = None


def recipe_section(worker_config: Any) -> Any:
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(worker_config, DictConfig):
        return None
    section = OmegaConf.select(worker_config, SECTION_IN_WORKER, default=None)
    if section is None:
        return None
    return OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else section


def hand_to_mindspeed(values: dict[str, Any]) -> None:
    """Ascend: MindSpeed's arguments before its adaptor registers its features (or onto them, if it already did)."""
    global _IMPORTED_BY_US
    set_pending_mindspeed_args(values)
    adaptor = sys.modules.get("mindspeed.megatron_adaptor")
    if adaptor is None:
        # First import: MindSpeed parses its arguments through the patched register_features_args and
        # registers the feature patches these flags select.
        adaptor = importlib.import_module("mindspeed.megatron_adaptor")
        _IMPORTED_BY_US = values
    elif _IMPORTED_BY_US != values:
        logger.warning("mindspeed.megatron_adaptor was imported before these recipe.megatron flags were known: they "
                       "are set on its parsed arguments, but feature patches chosen at import keep their choice")
    targets = [adaptor.get_mindspeed_args()]
    gv = sys.modules.get("megatron.training.global_vars")
    if gv is not None and getattr(gv, "_GLOBAL_ARGS", None) is not None:
        targets.append(gv._GLOBAL_ARGS)
    for ns in targets:
        for k, v in values.items():
            setattr(ns, k, v)


def check_weight_loading(worker_config: Any, recipe: Any) -> None:
    """verl's HF-weight loader and HF saver (models/mcore/loader.py, saver.py) assume equal stages; the
    distributed checkpoint, keyed by megatron's own global layer numbers, does not."""
    if not is_uneven(recipe):
        return
    for role in ("actor", "ref"):
        part = worker_config.get(role) if hasattr(worker_config, "get") else None
        if part is None:
            continue
        if part.get("load_weight", False) and not part.get("megatron", {}).get("use_dist_checkpointing", False):
            raise RecipeMegatronError(
                f"{SECTION}.num_layer_list is uneven and {role}.load_weight=True without "
                f"{role}.megatron.use_dist_checkpointing: verl's HF-weight loader needs equal stages; convert the "
                "model to a distributed checkpoint (python -m verl_patches.tools.hf_to_mcore) and load that")
        if "hf_model" in list((part.get("checkpoint") or {}).get("save_contents") or []):
            raise RecipeMegatronError(
                f"{SECTION}.num_layer_list is uneven and {role}.checkpoint.save_contents has 'hf_model': verl's HF "
                "saver needs equal stages; save the distributed checkpoint and convert it "
                "(python -m verl_patches.tools.mcore_to_hf)")


def wrap_init_hf_config_and_tf_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _init_hf_config_and_tf_config(self, model_path, tokenizer_or_path, dtype, override_model_config,
                                      override_transformer_config, trust_remote_code=False):
        section = recipe_section(getattr(self, "config", None))
        if section is None:
            return original(self, model_path, tokenizer_or_path, dtype, override_model_config,
                            override_transformer_config, trust_remote_code)
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from megatron.core import parallel_state as mpu
        from verl_patches.base import accelerator
        from verl_patches.train import fixed_routing

        recipe = ma.parse(section)
        # Before any model is built: the router patches (training and rollout) read it on every call.
        fixed_routing.configure_from_worker_config(self.config)
        tp, ep = mpu.get_tensor_model_parallel_world_size(), mpu.get_expert_model_parallel_world_size()
        etp = mpu.get_expert_tensor_parallel_world_size()
        pp, vpp = mpu.get_pipeline_model_parallel_world_size(), mpu.get_virtual_pipeline_model_parallel_world_size()
        # Parallel-layout checks first (the layer count is known only after the conversion): nothing is
        # built or handed to MindSpeed for a wrong layout.
        ma.check_layout(recipe, num_layers=sum(recipe.num_layer_list or ()), pp=pp, vpp=vpp, tp=tp, ep=ep, etp=etp)
        check_weight_loading(self.config, recipe)
        # MindSpeed-LLM's route on an Ascend rank where it is installed (a test hides it with a None in sys.modules,
        # which find_spec answers as absent).
        llm_route = accelerator.device_type() == "npu" and importlib.util.find_spec("mindspeed_llm") is not None
        if accelerator.device_type() == "npu":
            if llm_route:
                # The reference route: Megatron's global arguments through MindSpeed-LLM's parser, whose
                # adaptor applies MindSpeed's and MindSpeed-LLM's features, before the TransformerConfig.
                build_global_args(self.config, model_path, dtype, recipe, tp=tp, pp=pp, ep=ep, etp=etp,
                                  cp=mpu.get_context_parallel_world_size())
            else:
                hand_to_mindspeed(ma.mindspeed_args(recipe))
        else:
            if recipe.moe_tp_extend_ep:
                raise ma.RecipeMegatronError(
                    f"{ma.SECTION}.moe_tp_extend_ep needs MindSpeed (Ascend). megatron-core alone gives the same expert "
                    f"split with actor/ref megatron.expert_model_parallel_size = TP x EP = {tp * ep} and "
                    "expert_tensor_parallel_size = 1: set those and moe_tp_extend_ep: False")
            unused = [k for k in _MINDSPEED_ONLY if getattr(recipe, k)]
            if unused:
                logger.warning("%s: %s are MindSpeed (Ascend) kernels; not used on %s", ma.SECTION, unused,
                               accelerator.device_type())
        overrides = ma.merge_overrides(override_transformer_config, ma.transformer_config_overrides(recipe))
        original(self, model_path, tokenizer_or_path, dtype, override_model_config, overrides, trust_remote_code)
        tf = self.tf_config
        ma.check_layout(recipe, num_layers=tf.num_layers, pp=pp, vpp=vpp, tp=tp, ep=ep, etp=etp,
                        num_experts=tf.num_moe_experts)
        setattr(tf, LAYER_LIST_ATTR, recipe.num_layer_list)
        if llm_route:
            # MindSpeed-LLM's layers read the per-stage list and offsets from the TransformerConfig as int lists,
            # which its own core_transformer_config_from_args makes from --num-layer-list
            # (mindspeed_llm/training/arguments.py: core_transformer_config_from_args_wrapper); verl builds the
            # config from the HF config, which left the argument's string there ("3,1"[stage] is a str).
            from mindspeed_llm.training.arguments import get_layer_offset

            if recipe.num_layer_list:
                tf.num_layer_list = list(recipe.num_layer_list)
                tf.layer_offset = get_layer_offset(pp, tf.num_layer_list)
            else:
                tf.num_layer_list = None

    return _init_hf_config_and_tf_config


PATCHES = [
    Patch(
        feature="model_layout",
        id="verl.recipe_megatron.binding",
        target="verl.single_controller.base.megatron.worker:MegatronWorker._init_hf_config_and_tf_config",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(
            signature="def _init_hf_config_and_tf_config(self, model_path, tokenizer_or_path, dtype, "
                      "override_model_config, override_transformer_config, trust_remote_code=False)",
            source_sha="004b4fc175a1c1c6"),
        replacement=f"{__name__}:wrap_init_hf_config_and_tf_config",
        flag="actor_rollout_ref.rollout.recipe.megatron (absent: upstream behaviour)",
        why="recipe.megatron (uneven PP stages, moe_tp_extend_ep, swap optimizer, fused kernels; docs/RECIPE.md "
            "Hardware and layout) is read by nothing in verl 0.4.1; this is the last point before the model "
            "and optimizer are built where the worker's config, the parallel layout and the model's layer "
            "count are all known.",
        remove_when="verl passes a per-stage layer list and MindSpeed arguments itself (later verl calls "
                    "MindSpeed's repatch with override_transformer_config in the worker's __init__).",
    ),
]
