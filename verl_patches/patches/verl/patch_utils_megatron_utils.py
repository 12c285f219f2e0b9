"""verl's own layer-offset arithmetic follows recipe.megatron.num_layer_list, and the Adam betas reach
megatron-core's optimizer.

Upstream: verl/utils/megatron_utils.py:get_transformer_layer_offset(pipeline_rank, vp_rank, config),
verl's copy of megatron's offset for any stage (not only the caller's). normalize_model_name calls
it for every weight per_tensor_generator sends to the rollout, to turn a stage-local
``decoder.layers.<i>`` into the global layer name; it knows only even stages and megatron's
first / last-stage variant. We wrap it: with the list on the config the offset of stage
``pipeline_rank`` is the sum of the entries before it; otherwise upstream runs.

Upstream: verl/utils/megatron_utils.py:init_megatron_optim_config(optim_config) builds megatron-core's
OptimizerConfig from actor.optim with lr, min_lr, clip_grad and weight_decay only, so Adam runs with
megatron's defaults (beta2 0.999) whatever the YAML says. We wrap it: adam_beta1, adam_beta2 and
adam_eps given in actor.optim are set on the config upstream returns; absent keys keep its values.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.train.layer_list import FLAG, layer_list
from verl_patches.config.megatron_args import stage_span


def wrap_get_transformer_layer_offset(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_transformer_layer_offset(pipeline_rank, vp_rank, config):
        lst = layer_list(config)
        if lst is None:
            return original(pipeline_rank, vp_rank, config)

        return stage_span(lst, pipeline_rank)[0]

    return get_transformer_layer_offset


ADAM_KEYS = ("adam_beta1", "adam_beta2", "adam_eps")


def wrap_init_megatron_optim_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_megatron_optim_config(optim_config, *args, **kwargs):
        config = original(optim_config, *args, **kwargs)
        for key in ADAM_KEYS:
            value = optim_config.get(key, None)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"actor.optim.{key} must be a number, got {value!r}")
            setattr(config, key, float(value))
        return config

    return init_megatron_optim_config


PATCHES = [
    Patch(
        feature="model_layout",
        id="verl.num_layer_list.layer_offset",
        target="verl.utils.megatron_utils:get_transformer_layer_offset",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(signature="def get_transformer_layer_offset(pipeline_rank, vp_rank, config: TransformerConfig)",
                                source_sha="bf947a58b3101827"),
        replacement=f"{__name__}:wrap_get_transformer_layer_offset",
        flag=FLAG,
        why="The names of the weights sent to vLLM (per_tensor_generator -> normalize_model_name) must carry the "
            "same global layer numbers as megatron's uneven stages, or stage 1's first layer would be named 8 "
            "instead of 7.",
        remove_when="verl derives the offset from megatron's own layout (or passes a per-stage layer list).",
    ),
    Patch(
        feature="model_layout",
        id="verl.optim.adam_betas",
        target="verl.utils.megatron_utils:init_megatron_optim_config",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(signature="def init_megatron_optim_config(optim_config: Dict) -> OptimizerConfig",
                                source_sha="273362ab847c28d5"),
        replacement=f"{__name__}:wrap_init_megatron_optim_config",
        flag="actor_rollout_ref.actor.optim.adam_beta1 / adam_beta2 / adam_eps (absent: megatron-core's defaults)",
        why="The reference run trains with Adam beta2 0.95; verl 0.4.1 passes no betas to megatron-core, whose "
            "default is 0.999, so the recipe's value would be silently ignored.",
        remove_when="verl's init_megatron_optim_config reads the Adam betas from the optim config.",
    ),
]
