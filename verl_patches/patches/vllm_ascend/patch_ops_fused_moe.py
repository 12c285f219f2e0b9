"""Fixed (balanced) expert routing in vLLM-Ascend's fused MoE for the random-init benchmark (Ascend only).

Upstream: vllm_ascend/ops/fused_moe.py:AscendFusedMoE.forward takes ``enable_force_load_balance``,
vLLM-Ascend 0.9.1's own forced balance: its unquantised MoE method then draws every token's experts
uniformly (torch.randint_like over all experts) instead of the router's top-k. Its callers
(CustomDeepseekV2MoE.forward) pass it only during the profile run. We wrap it: with
recipe.fixed_routing on, every call passes True; off, the caller's value stands. The module needs
torch_npu, so the fingerprint is read from the installed source and the wrapper is tested on a
stand-in with the same signature.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

ARG = "enable_force_load_balance"


def wrap_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    # Position of the flag among the arguments after self, so a positional caller is honoured too.
    names = [p.name for p in inspect.signature(original).parameters.values()][1:]
    index = names.index(ARG)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.train import fixed_routing

        if fixed_routing.enabled():
            if len(args) > index:
                args = (*args[:index], True, *args[index + 1:])
            else:
                kwargs[ARG] = True
        return original(self, *args, **kwargs)

    return forward


PATCHES = [
    Patch(
        feature="fixed_routing",
        id="vllm_ascend.fixed_routing.force_load_balance",
        target="vllm_ascend.ops.fused_moe:AscendFusedMoE.forward",
        kind="wrap",
        phases=("worker", "engine_core"),
        upstream="vllm_ascend",
        versions="==0.9.1",
        fingerprint=Fingerprint(
            signature="def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, is_prefill: bool, "
                      "enable_force_load_balance: bool=False, top_k: Optional[int]=None, "
                      "shared_experts: Optional[Any]=None, gate: Optional[Any]=None, "
                      "_metadata_for_padding: Optional[MetadataForPadding]=None)",
            source_sha="68ea1336710f2e22"),
        replacement=f"{__name__}:wrap_forward",
        flag="actor_rollout_ref.rollout.recipe.fixed_routing (default False; VERL_PATCHES_FIXED_ROUTING)",
        why="The random-init benchmark generates with every expert equally loaded, as the reference measured its "
            "250 TPS/card; vLLM-Ascend 0.9.1 has the mechanism (enable_force_load_balance) but turns it on only "
            "for its profile run.",
        remove_when="vLLM-Ascend exposes the forced balance as an engine option the rollout settings can set.",
        platforms=("npu",),
    ),
]
