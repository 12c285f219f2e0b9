"""DeepSeek-V3's TransformerConfig: what verl 0.4.1's converter leaves out, added under the user's overrides.

Upstream: verl/models/mcore/registry.py:hf_to_mcore_config, the one entry point the Megatron worker
(and get_mcore_weight_converter) use; it dispatches through a dict that holds
config_converter.hf_to_mcore_config_dpskv3 itself, so wrapping the converter function would not
reach it. For DeepseekV3ForCausalLM we pass verl_patches.megatron_args.deepseek_v3_overrides
(group-limited routing n_group / topk_group, the RoPE type when the config names it rope_type)
as keyword overrides, with the caller's own override_transformer_config entries winning; the
converter's MLA, sigmoid router, expert bias, shared experts, moe_layer_freq from
first_k_dense_replace, grouped GEMM and alltoall dispatcher are right and stay as they are.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

ARCH = "DeepseekV3ForCausalLM"


def wrap_hf_to_mcore_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def hf_to_mcore_config(hf_config, dtype, **override_transformer_config_kwargs):
        if list(getattr(hf_config, "architectures", None) or []) != [ARCH]:
            return original(hf_config, dtype, **override_transformer_config_kwargs)
        from verl_patches.megatron_args import deepseek_v3_overrides, merge_overrides

        ours = deepseek_v3_overrides(hf_config.to_dict())
        return original(hf_config, dtype, **merge_overrides(override_transformer_config_kwargs, ours))

    return hf_to_mcore_config


PATCHES = [
    Patch(
        feature="model_layout",
        id="verl.mcore_config.deepseek_v3",
        target="verl.models.mcore.registry:hf_to_mcore_config",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(
            signature="def hf_to_mcore_config(hf_config: PretrainedConfig, dtype: torch.dtype, "
                      "**override_transformer_config_kwargs) -> TransformerConfig",
            source_sha="db9da8c97878a099"),
        replacement=f"{__name__}:wrap_hf_to_mcore_config",
        flag="always on for DeepseekV3ForCausalLM; any key in actor.megatron.override_transformer_config wins",
        why="DeepSeek-V3 routes each token to 8 experts inside 4 of 8 expert groups (n_group / topk_group); "
            "verl 0.4.1 drops the groups, so the trained router differs from the model's and from vLLM's.",
        remove_when="verl's hf_to_mcore_config_dpskv3 sets moe_router_num_groups / moe_router_group_topk "
                    "(later verl releases do) and reads rope_type.",
    ),
]
