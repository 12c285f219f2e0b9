"""vLLM's per-step "is any DP rank unfinished?" all-reduce on the device group instead of gloo.

Upstream: vllm/config.py:ParallelConfig.has_unfinished_dp (a staticmethod) all-reduces one int
on the stateless gloo DP group that LLMEngine (in-process, verl's SPMD rollout) and
DPEngineCoreProc create; verl's rollout asks it once per decode step, about 3000 times per
rollout. We wrap it: when this process holds vLLM's DP GroupCoordinator and the flag is on, the
same MAX all-reduce runs on that coordinator's device group (HCCL / NCCL); otherwise the
original runs. Both groups hold the same ranks (the DP domain gives each DP group its own port).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def wrap_has_unfinished_dp(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def has_unfinished_dp(dp_group: Any, has_unfinished: bool) -> bool:
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.rollout.dp_sync import any_unfinished, vllm_device_dp_group

        size = dp_group.size() if hasattr(dp_group, "size") else None
        target = vllm_device_dp_group(size)
        if target is None:
            return original(dp_group, has_unfinished)
        return any_unfinished(has_unfinished, *target)

    return has_unfinished_dp


PATCHES = [
    Patch(
        feature="dp_domain",
        id="vllm.dp_sync.unfinished_on_device",
        target="vllm.config:ParallelConfig.has_unfinished_dp",
        kind="wrap",
        phases=("worker", "engine_core"),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(
            signature="def has_unfinished_dp(dp_group: 'ProcessGroup', has_unfinished: bool) -> bool",
            source_sha="d33cb38d954758b5",
        ),
        replacement=f"{__name__}:wrap_has_unfinished_dp",
        flag="actor_rollout_ref.rollout.recipe.dp_sync_on_device (default True; the rollout patch exports it "
             "as VERL_PATCHES_DP_SYNC_ON_DEVICE=0/1 for vLLM's engine loop)",
        why="Each decode step every DP rank all-reduces 'unfinished?' on a gloo group: 10-14 ms at 256 dies x "
            "about 3000 steps. On the device communicator it is under 3 ms (rollout 385 -> 322 s; docs/RECIPE.md "
            "item 6, docs/DESIGN.md section 6).",
        remove_when="vLLM runs the DP 'unfinished' agreement on the device group itself (or lets the platform "
                    "choose the backend of the stateless DP group and has_unfinished_dp's tensor device).",
    ),
]
