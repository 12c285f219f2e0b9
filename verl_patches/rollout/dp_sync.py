"""vLLM's per-step DP agreement as plain collectives on a given group and device.

Every decode step each DP rank asks "is any rank unfinished?" and "does any rank prefill, how many
tokens does each run?". Upstream runs these on a gloo group (10-14 ms at 256 dies); on the device
group (HCCL / NCCL) they take under 3 ms (docs/RECIPE.md item 6). Same results, one collective each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from verl_patches.base import env

# The switch, exported by the rollout patch from actor_rollout_ref.rollout.recipe.dp_sync_on_device:
# vLLM's engine loop calls these functions without any config object that could carry it.
FLAG_ENV = "VERL_PATCHES_DP_SYNC_ON_DEVICE"


def dp_sync_on_device() -> bool:
    """On unless the flag says off (the recipe's default is on)."""
    return bool(env.get(FLAG_ENV))


def any_unfinished(has_unfinished: bool, group: Any, device: torch.device) -> bool:
    """Logical OR of ``has_unfinished`` over ``group`` (one MAX all-reduce of one int on ``device``)."""
    flag = torch.tensor([1 if has_unfinished else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def tokens_across_dp(num_tokens: int, dp_size: int, dp_rank: int, group: Any, device: torch.device) -> torch.Tensor:
    """Every DP rank's token count, as vLLM's DPMetadata wants it: an int32 CPU tensor of dp_size."""
    _check_rank(dp_size, dp_rank)
    counts = torch.zeros(dp_size, dtype=torch.int32)
    counts[dp_rank] = int(num_tokens)
    counts = counts.to(device)  # filled on the host: one copy, no fill kernels on the device
    dist.all_reduce(counts, group=group)
    return counts.cpu()


@dataclass(frozen=True)
class ForwardAgreement:
    padded_across_dp: torch.Tensor  # each rank's padded token count (CPU int32)
    tokens_across_dp: torch.Tensor  # each rank's unpadded token count (CPU int32)
    with_prefill: bool  # any rank prefills
    enable_dbo: bool  # every rank can run dual-batch overlap


def agree_forward(padded_tokens: int, num_tokens: int, with_prefill: bool, enable_dbo: bool,
                  dp_size: int, dp_rank: int, group: Any, device: torch.device) -> ForwardAgreement:
    """vLLM-Ascend's per-step DP agreement in one SUM all-reduce on ``device``.

    Layout: [padded counts (dp_size), counts (dp_size), prefill votes, votes against DBO];
    a vote sum above zero means some rank voted.
    """
    _check_rank(dp_size, dp_rank)
    buf = torch.zeros(2 * dp_size + 2, dtype=torch.int32)
    buf[dp_rank] = int(padded_tokens)
    buf[dp_size + dp_rank] = int(num_tokens)
    buf[2 * dp_size] = 1 if with_prefill else 0
    buf[2 * dp_size + 1] = 0 if enable_dbo else 1
    buf = buf.to(device)
    dist.all_reduce(buf, group=group)
    host = buf.cpu()  # one device-to-host copy for everything the host decides on
    return ForwardAgreement(host[:dp_size].clone(), host[dp_size:2 * dp_size].clone(),
                            bool(host[2 * dp_size] > 0), not bool(host[2 * dp_size + 1] > 0))


def _check_rank(dp_size: int, dp_rank: int) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"DP rank {dp_rank} outside a DP group of size {dp_size}")


def vllm_device_dp_group(expected_size: Optional[int] = None) -> Optional[tuple[Any, torch.device]]:
    """vLLM's DP GroupCoordinator's device group and device, or None to keep upstream's gloo path.

    None when the flag is off, when this process has no vLLM DP group (an engine-core process
    whose workers live elsewhere), or when its size differs from the group the caller was given
    (then the two groups are not the same set of ranks and the answer would differ).
    """
    if not dp_sync_on_device():
        return None
    # Lazy: vLLM's parallel state only inside a vLLM rank; the DP agreement module loads without vLLM.
    from vllm.distributed import parallel_state as ps

    coord = ps._DP  # read the module global: get_dp_group() asserts when it is unset
    if coord is None or coord.world_size <= 1 or coord.device_group is None:
        return None
    if expected_size is not None and coord.world_size != expected_size:
        return None
    return coord.device_group, coord.device
