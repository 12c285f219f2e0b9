"""Fixed (balanced) expert routing in vLLM's fused MoE for the random-init benchmark run (CUDA path).

Upstream: vllm/model_executor/layers/fused_moe/layer.py:FusedMoE.select_experts, the static method
every MoE quantisation method (unquantised included) calls for (topk_weights, topk_ids). vLLM 0.9.1 has
no forced-balance switch. We wrap it: with recipe.fixed_routing on, the ids become the balanced
assignment of verl_patches/train/fixed_routing.py over all experts (global ids; vLLM's expert map then
places them per EP rank) and the weights stay the router's; off, upstream runs unchanged. vLLM-Ascend
replaces this layer on Ascend; its own switch is wired in patches/vllm_ascend/patch_ops_fused_moe.py.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def wrap_select_experts(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def select_experts(hidden_states, router_logits, *args, **kwargs):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.train import fixed_routing

        topk_weights, topk_ids = original(hidden_states, router_logits, *args, **kwargs)
        if not fixed_routing.enabled():
            return topk_weights, topk_ids
        tokens, top_k = topk_ids.shape
        ids = fixed_routing.balanced_expert_ids(tokens, top_k, router_logits.shape[-1],
                                                device=topk_ids.device, dtype=topk_ids.dtype)
        return topk_weights, ids

    return select_experts


PATCHES = [
    Patch(
        feature="fixed_routing",
        id="vllm.fixed_routing.select_experts",
        target="vllm.model_executor.layers.fused_moe.layer:FusedMoE.select_experts",
        kind="wrap",
        phases=("worker", "engine_core"),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(
            signature="def select_experts(hidden_states: torch.Tensor, router_logits: torch.Tensor, top_k: int, "
                      "use_grouped_topk: bool, renormalize: bool, topk_group: Optional[int]=None, "
                      "num_expert_group: Optional[int]=None, custom_routing_function: Optional[Callable]=None, "
                      "scoring_func: str='softmax', e_score_correction_bias: Optional[torch.Tensor]=None, "
                      "indices_type: Optional[torch.dtype]=None)",
            source_sha="65f4fc6c27791aa1"),
        replacement=f"{__name__}:wrap_select_experts",
        flag="actor_rollout_ref.rollout.recipe.fixed_routing (default False; VERL_PATCHES_FIXED_ROUTING)",
        why="The random-init benchmark compares generation throughput with every expert equally loaded, as the "
            "reference measured it; vLLM 0.9.1 has no switch for a forced balanced assignment.",
        remove_when="vLLM offers a forced-balance routing option that the rollout settings can set.",
        platforms=("cuda", "cpu"),
    ),
]
