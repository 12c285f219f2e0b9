"""Uneven pipeline stages from recipe.megatron.num_layer_list: how many layers this stage builds.

Upstream: megatron/core/transformer/transformer_block.py:get_num_layers_to_build. megatron-core
0.12.1 can make only the first and last stages uneven (num_layers_in_first/last_pipeline_stage,
the middle ones equal), so DeepSeek-V3's 61 layers as 7,7,8,8,8,8,8,7 over PP8 cannot be
expressed. MindSpeed's num_layer_list lives in MindSpeed-LLM (not locked here), so on every
platform we wrap: when the config carries the list (the worker binding in
patch_single_controller_base_megatron_worker.py attaches it), this stage's count is its entry;
otherwise upstream runs. The matching offset is patch_core_transformer_transformer_layer.py.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.train.layer_list import FLAG, layer_list
from verl_patches.config.megatron_args import stage_span


def wrap_get_num_layers_to_build(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_num_layers_to_build(config, *args, **kwargs):
        lst = layer_list(config)
        if lst is None:
            return original(config, *args, **kwargs)
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from megatron.core import parallel_state

        return stage_span(lst, parallel_state.get_pipeline_model_parallel_rank())[1]

    return get_num_layers_to_build


PATCHES = [
    Patch(
        feature="model_layout",
        id="megatron.num_layer_list.layers_to_build",
        target="megatron.core.transformer.transformer_block:get_num_layers_to_build",
        kind="wrap",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint(signature="def get_num_layers_to_build(config: TransformerConfig) -> int",
                                source_sha="e9291a37802081ec"),
        replacement=f"{__name__}:wrap_get_num_layers_to_build",
        flag=FLAG,
        why="The recipe's PP8 layout is 7,7,8,8,8,8,8,7 (docs/RECIPE.md, Hardware and layout); megatron-core 0.12.1 "
            "only supports an uneven first / last stage and asserts that 61 - 14 layers split evenly over the "
            "6 middle stages.",
        remove_when="megatron-core supports an arbitrary per-stage layer list (its later "
                    "pipeline_model_parallel_layout) and verl passes it through.",
    ),
]
