"""Uneven pipeline stages from recipe.megatron.num_layer_list: the global number of a stage's first layer.

Upstream: megatron/core/transformer/transformer_layer.py:get_transformer_layer_offset, which
TransformerLayer (layer_number), TransformerBlock (sharded_state_dict keys) and the GPT block
spec (which layers are dense and which MoE, from moe_layer_freq) all use. With the list on the
config the offset is the sum of the earlier stages' entries; otherwise upstream runs.
TransformerLayer._get_layer_offset calls this module-level function, so it follows.
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
    def get_transformer_layer_offset(config, *args, **kwargs):
        lst = layer_list(config)
        if lst is None:
            return original(config, *args, **kwargs)
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from megatron.core import parallel_state

        return stage_span(lst, parallel_state.get_pipeline_model_parallel_rank())[0]

    return get_transformer_layer_offset


PATCHES = [
    Patch(
        feature="model_layout",
        id="megatron.num_layer_list.layer_offset", requires=("megatron.num_layer_list.layers_to_build",),
        target="megatron.core.transformer.transformer_layer:get_transformer_layer_offset",
        kind="wrap",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint(signature="def get_transformer_layer_offset(config: TransformerConfig)",
                                source_sha="2811717bcfeedea9"),
        replacement=f"{__name__}:wrap_get_transformer_layer_offset",
        flag=FLAG,
        why="Global layer numbers must follow the uneven list: they pick dense vs MoE layers "
            "(first_k_dense_replace), name the distributed-checkpoint shards and the weights sent to vLLM.",
        remove_when="Together with megatron.num_layer_list.layers_to_build.",
    ),
]
