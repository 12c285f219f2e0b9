"""The recipe's uneven pipeline layer list as megatron-core's TransformerConfig carries it: the worker
binding (patch verl.megatron_utils.layer_list) attaches recipe.megatron.num_layer_list to the config, and
the block and layer patches (megatron.transformer_block.*, megatron.transformer_layer.*) read it back.
Shared here, below the patches that set and read it."""

from __future__ import annotations

from typing import Any

from verl_patches.core import stash

# The attribute the binding sets on the TransformerConfig (TransformerConfig has no such field).
LAYER_LIST_ATTR = stash.attr("num_layer_list")
FLAG = "actor_rollout_ref.rollout.recipe.megatron.num_layer_list (attached to the TransformerConfig by the worker binding)"


def layer_list(config: Any) -> tuple[int, ...] | None:
    return getattr(config, LAYER_LIST_ATTR, None)
