"""Rank coordinates: which TP / PP / EP / DP position each global rank holds on the training side
(megatron-core's group order) and on the rollout side (vLLM's), and vLLM's expert ranges."""

from __future__ import annotations

from dataclasses import dataclass

from verl_patches.reshard.layouts import RolloutLayout
from verl_patches.reshard.model import LayoutError


@dataclass(frozen=True)
class TrainCoords:
    tp_groups: list[list[int]]
    pp_groups: list[list[int]]
    dp_groups: list[list[int]]
    expert_groups: list[list[int]]
    tp_rank: list[int]
    pp_rank: list[int]
    expert_rank: list[int]


def _index_in(groups: list[list[int]], world: int) -> list[int]:
    idx = [-1] * world
    for g in groups:
        for i, r in enumerate(g):
            idx[r] = i
    return idx


def train_coords(t: int, p: int, e: int, world: int) -> TrainCoords:
    """Rank coordinates from megatron-core's own RankGenerator, configured as
    parallel_state.initialize_model_parallel configures it (order tp-cp-ep-dp-pp).

    moe_tp_extend_ep is expressed in megatron-core 0.12.1 terms as expert_tensor_parallel=1,
    expert_model_parallel=t*e: the expert group is then TP x EP (tests check this against
    initialize_model_parallel on gloo)."""
    try:
        # Lazy: the planner runs without megatron-core and torch (metadata only); only the rank groups need them.
        from megatron.core.parallel_state import RankGenerator
    except ImportError as exc:  # pragma: no cover - megatron-core is a runtime requirement
        raise LayoutError("megatron-core (0.12.1) is needed for Megatron rank coordinates") from exc
    d = world // (t * p)
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=t, ep=1, dp=d, pp=p, cp=1, order=order, rank_offset=0)
    expert = RankGenerator(tp=1, ep=t * e, dp=world // (t * e * p), pp=p, cp=1, order=order,
                           rank_offset=0)
    tp_g, pp_g, dp_g = dense.get_ranks("tp"), dense.get_ranks("pp"), dense.get_ranks("dp")
    ep_g = expert.get_ranks("ep")
    return TrainCoords(tp_g, pp_g, dp_g, ep_g, _index_in(tp_g, world), _index_in(pp_g, world),
                       _index_in(ep_g, world))


@dataclass(frozen=True)
class RolloutCoords:
    tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    ep_groups: list[list[int]]
    tp_rank: list[int]
    ep_rank: list[int]


def rollout_coords(r: RolloutLayout) -> RolloutCoords:
    """vLLM 0.9.1 parallel_state.initialize_model_parallel: ranks laid out as
    arange(world).reshape(ExternalDP, DP, PP, TP); the EP group of an instance is its DP x TP
    ranks, EP rank = dp_rank * tp + tp_rank (FusedMoEParallelConfig.make). Tests compare
    these groups with the ones vLLM builds on gloo."""
    # Lazy: the planner runs without megatron-core and torch (metadata only); only the rank groups need them.
    import torch

    all_ranks = torch.arange(r.world).reshape(r.instances, r.dp, 1, r.tp)
    tp_g = [x.tolist() for x in all_ranks.view(-1, r.tp).unbind(0)]
    dp_g = [x.tolist() for x in all_ranks.transpose(1, 3).reshape(-1, r.dp).unbind(0)]
    ep_g = [x.tolist() for x in all_ranks.transpose(1, 2).reshape(-1, r.dp * r.tp).unbind(0)]
    return RolloutCoords(tp_g, dp_g, ep_g, _index_in(tp_g, r.world), _index_in(ep_g, r.world))


def vllm_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """Global experts [a, b) hosted by EP rank (vLLM 0.9.1 determine_expert_map: E // EP
    each, the last rank takes the remainder)."""
    if ep_size == 1:
        return 0, num_experts
    per = num_experts // ep_size
    if ep_rank < ep_size - 1:
        return ep_rank * per, (ep_rank + 1) * per
    return ep_rank * per, num_experts
