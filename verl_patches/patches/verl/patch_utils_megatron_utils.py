"""verl's own layer-offset arithmetic follows recipe.megatron.num_layer_list.

Upstream: verl/utils/megatron_utils.py:get_transformer_layer_offset(pipeline_rank, vp_rank, config),
verl's copy of megatron's offset for any stage (not only the caller's). normalize_model_name calls
it for every weight per_tensor_generator sends to the rollout, to turn a stage-local
``decoder.layers.<i>`` into the global layer name; it knows only even stages and megatron's
first / last-stage variant. We wrap it: with the list on the config the offset of stage
``pipeline_rank`` is the sum of the entries before it; otherwise upstream runs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.patches.megatron.patch_core_transformer_transformer_block import FLAG, layer_list


def wrap_get_transformer_layer_offset(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_transformer_layer_offset(pipeline_rank, vp_rank, config):
        lst = layer_list(config)
        if lst is None:
            return original(pipeline_rank, vp_rank, config)
        from verl_patches.megatron_args import stage_span

        return stage_span(lst, pipeline_rank)[0]

    return get_transformer_layer_offset


PATCHES = [
    Patch(
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
]
