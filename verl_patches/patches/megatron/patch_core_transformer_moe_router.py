"""Fixed (balanced) expert routing in megatron-core's router for the random-init benchmark run.

Upstream: megatron/core/transformer/moe/router.py:TopKRouter.routing(logits) turns the gate's logits
into (probs, routing_map) by the configured load-balancing scheme. megatron-core 0.12.1 has no switch
that forces a balanced assignment (``moe_router_force_load_balancing`` arrives in a later release) and
MindSpeed's only one (v2.2.0_core_r0.12.1, as 2.1.0) is inside its auto-tuning profiler (MindSpeed-LLM
v2.2.0 has none). We wrap it: with recipe.fixed_routing
on, token i goes to experts (i * top_k + j) mod E (verl_patches/train/fixed_routing.py), weighted by the
router's own scores for those experts; off, upstream runs unchanged. The aux loss and the expert-bias
counters are not updated while it is on: the routing they would balance is not the one used.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def wrap_routing(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def routing(self, logits):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.train import fixed_routing

        if not fixed_routing.enabled():
            return original(self, logits)
        cfg = self.config
        if cfg.moe_token_dispatcher_type == "alltoall_seq":
            # Upstream gathers the logits over the sequence-parallel region first for this dispatcher.
            raise fixed_routing.FixedRoutingError(
                f"{fixed_routing.FLAG}=True supports the alltoall and allgather dispatchers, not alltoall_seq")
        logits = logits.view(-1, cfg.num_moe_experts)
        return fixed_routing.routing_map_and_probs(logits, self.topk, cfg.moe_router_score_function,
                                                   cfg.moe_router_topk_scaling_factor)

    return routing


PATCHES = [
    Patch(
        feature="fixed_routing",
        id="megatron.fixed_routing.router",
        target="megatron.core.transformer.moe.router:TopKRouter.routing",
        kind="wrap",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint(signature="def routing(self, logits: torch.Tensor)", source_sha="dab261fde967a687"),
        replacement=f"{__name__}:wrap_routing",
        flag="actor_rollout_ref.rollout.recipe.fixed_routing (default False; the binding exports "
             "VERL_PATCHES_FIXED_ROUTING)",
        why="The reference's random-init throughput (250 TPS/card) was measured with every expert receiving the "
            "same load; with random weights the router's choice is arbitrary and uneven, which changes the "
            "step time being compared. megatron-core 0.12.1 offers no forced balance.",
        remove_when="megatron-core's moe_router_force_load_balancing (a later release) is in the lock and the "
                    "binding sets it from the same key.",
    ),
]
