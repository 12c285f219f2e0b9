"""The process groups megatron-core and vLLM themselves build for a layout, read on each rank
(gloo is enough): tests and preflight compare them with the placements' rank coordinates.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from verl_patches.rigs.testing.upstream_env import prepare_cpu_upstream


def megatron_groups(rank: int, world: int, cases: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """initialize_model_parallel as the recipe configures it (moe_tp_extend_ep: expert group of
    t*e ranks without expert TP) and the groups and ranks it reports for this rank."""
    # Lazy: megatron-core and vLLM load inside the rank that builds their groups.
    from megatron.core import parallel_state as ps

    out = []
    for t, p, e in cases:
        ps.initialize_model_parallel(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                     expert_model_parallel_size=t * e, expert_tensor_parallel_size=1)
        out.append({
            "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
            "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
            "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
            "ep": dist.get_process_group_ranks(ps.get_expert_model_parallel_group()),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank(),
        })
        ps.destroy_model_parallel()
    return out


def vllm_groups(rank: int, world: int, cases: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """vLLM 0.9.1's own groups for K instances of DP x TP with expert parallel, plus the EP rank
    and expert range its FusedMoE computes (FusedMoEParallelConfig.make, determine_expert_map)."""
    os.environ.setdefault("VLLM_PLUGINS", "verl_patches")

    prepare_cpu_upstream()
    # Lazy: megatron-core and vLLM load inside the rank that builds their groups.
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as vps
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEParallelConfig, determine_expert_map

    out = []
    for tp, dp, experts in cases:
        cfg = VllmConfig(device_config=DeviceConfig("cpu"))
        cfg.parallel_config.data_parallel_size = dp
        cfg.parallel_config.enable_expert_parallel = True
        with set_current_vllm_config(cfg):
            vps.init_distributed_environment(world, rank, "env://", rank, "gloo")
            vps.initialize_model_parallel(tp, 1, backend="gloo")
            moe = FusedMoEParallelConfig.make(tp_size_=tp, dp_size_=dp, vllm_parallel_config=cfg.parallel_config)
            _, emap = determine_expert_map(moe.ep_size, moe.ep_rank, experts)
            hosted = list(range(experts)) if emap is None else [i for i in range(experts) if int(emap[i]) >= 0]
            out.append({"tp": list(vps.get_tp_group().ranks), "dp": list(vps.get_dp_group().ranks),
                        "ep": list(vps.get_ep_group().ranks), "ep_rank": moe.ep_rank,
                        "ep_size": moe.ep_size, "experts": hosted,
                        "tp_rank": vps.get_tp_group().rank_in_group})
            vps.destroy_model_parallel()
    return out


def upstream_groups(rank: int, world: int, mcases: list[tuple[int, int, int]],
                    vcases: list[tuple[int, int, int]]) -> dict[str, Any]:
    return {"megatron": megatron_groups(rank, world, mcases), "vllm": vllm_groups(rank, world, vcases)}
