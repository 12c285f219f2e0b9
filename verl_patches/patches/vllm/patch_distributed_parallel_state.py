"""vLLM's model-parallel groups for the recipe's DP domain: EP over the whole DP group, checked before use.

Upstream: vllm/distributed/parallel_state.py:initialize_model_parallel builds TP, PP, DP and EP
groups with its own functions (init_model_parallel_group) from the world size and the current
config's data_parallel_size: ExternalDP x DP x PP x TP, EP = DP x TP. With VLLM_DP_* set by the
rollout patch, it builds exactly the recipe's groups (DP128 x TP2 = EP256 over all 256 dies).
Two things upstream leaves silent: a vLLM config made before VLLM_DP_* was set (DP 1: EP shrinks
to TP, no error), and a DP rank that is not the rank's position in the DP group (DPMetadata then
sums token counts into the wrong slots). We wrap it: the config is checked against the domain
before the groups are built, vLLM builds them, and the result is checked against the domain,
so a wrong layout fails on the first rank with a message instead of hanging at the DP rendezvous.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.rollout.dp_domain import DPSpec, check_vllm_config, check_vllm_groups, derive_dp_domain


def wrap_initialize_model_parallel(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                                  backend: Optional[str] = None) -> None:
        spec = DPSpec.from_env()
        if spec is None:  # no recipe DP domain in this process: upstream behaviour
            return original(tensor_model_parallel_size, pipeline_model_parallel_size, backend)

        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        import torch.distributed as dist
        from vllm.config import get_current_vllm_config
        from vllm.distributed import parallel_state as ps

        domain = derive_dp_domain(dist.get_rank(), dist.get_world_size(), spec)
        pc = get_current_vllm_config().parallel_config
        check_vllm_config(domain, pc.data_parallel_size, pc.data_parallel_rank, tensor_model_parallel_size,
                          pipeline_model_parallel_size)
        original(tensor_model_parallel_size, pipeline_model_parallel_size, backend)
        check_vllm_groups(domain, ps.get_dp_group().ranks, ps.get_ep_group().ranks, ps.get_tp_group().ranks)

    return initialize_model_parallel


PATCHES = [
    Patch(
        feature="dp_domain",
        id="vllm.parallel_state.dp_domain",
        target="vllm.distributed.parallel_state:initialize_model_parallel",
        kind="wrap",
        phases=("worker", "engine_core"),
        upstream="vllm",
        versions="==0.9.1",
        fingerprint=Fingerprint(
            signature="def initialize_model_parallel(tensor_model_parallel_size: int=1, "
                      "pipeline_model_parallel_size: int=1, backend: Optional[str]=None) -> None",
            source_sha="e87d26ed1f2b5452",
        ),
        replacement=f"{__name__}:wrap_initialize_model_parallel",
        flag="VERL_PATCHES_VLLM_DP_DOMAIN (set by the rollout patch from actor_rollout_ref.rollout.recipe.vllm_dp; "
             "unset: upstream behaviour)",
        why="The recipe spreads experts over every die: vLLM data parallel inside one engine group "
            "(DP128 x TP2 = EP256), built by vLLM's own initialize_model_parallel from VLLM_DP_*. A config "
            "without the domain or a DP rank out of place builds wrong groups silently (EP = TP, or token "
            "counts summed into the wrong DP slot) and the run hangs or diverges; the wrap checks the config "
            "and the built DP / EP / TP groups against the domain (docs/RECIPE.md item 5, docs/DESIGN.md section 6).",
        remove_when="vLLM validates data_parallel_rank against its DP group and supports DP with the external "
                    "launcher natively (vLLM >= 0.10 has external-launcher DP), and verl sets the DP domain itself.",
    ),
]
