"""The weight fingerprint on several ranks (tests/reshard/test_fingerprint.py): every rank checks the
ground-truth rollout shards, each method's output, and two corruptions of one parameter on rank 5
(a flipped bit; an expert stack written transposed, the vLLM-Ascend bug's shape)."""

from __future__ import annotations

import torch

from verl_patches.reshard.checksum import WeightMismatchError, verify
from verl_patches.reshard.weight_sync import execute
from verl_patches.reshard.shards import full_state, logical_state, rollout_shards, train_shards


def _faulty(rank: int, roll: dict, fault: str) -> str:
    """Corrupt one parameter on rank 5 (returns its name there, '' elsewhere)."""
    if rank != 5:
        return ""
    if fault == "flip":
        name = sorted(n for n in roll if n.endswith("kv_a_proj_with_mqa.weight"))[-1]
        bits = roll[name].view(torch.int16) if roll[name].element_size() == 2 else roll[name].view(torch.int32)
        bits.view(-1)[7] ^= 1
    else:  # the expert stack written transposed, then read in its own shape
        name = sorted(n for n in roll if n.endswith("mlp.experts.w2_weight"))[0]
        w = roll[name]
        w.copy_(w.transpose(1, 2).contiguous().view(w.shape))
    return name


def check_fingerprints(rank: int, world: int, plans: list) -> list[dict]:
    """For run_distributed: per plan, the checked parameter counts and each fault's error (or None)."""
    out = []
    for plan in plans:
        P = plan.placements
        logical = logical_state(P, full_state(P, seed=3, dtype=plan.dtype))
        train = train_shards(P, rank, logical)
        res: dict = {}
        truth = rollout_shards(P, rank, logical)
        res["truth"] = verify(plan, rank, train, truth, step=0).params
        methods = ("direct", "upstream", "alltoallv") if P.train.expert_storage == "grouped" else ("direct",)
        for method in methods:
            roll = {n: torch.full_like(t, 7.0) for n, t in truth.items()}
            execute(plan, rank, train, roll, method=method)
            res[method] = verify(plan, rank, train, roll, step=1).params
        for fault in ("flip", "transpose"):
            roll = {n: t.clone() for n, t in truth.items()}
            named = _faulty(rank, roll, fault)
            try:
                verify(plan, rank, train, roll, step=3)
                res[fault] = None
            except WeightMismatchError as e:
                res[fault] = (str(e), named)
        out.append(res)
    return out
