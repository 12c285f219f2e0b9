"""Bit-exactness check of the reshard methods on one rank of a running process group: seeded
full model -> this rank's training shards -> each method -> compare with the expected shards.

Run on every rank together (tests through run_distributed; preflight on the real cluster).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_patches.config.settings import METHODS
from verl_patches.reshard.weight_sync import execute
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import ModelConfig
from verl_patches.reshard.placements import build_placements
from verl_patches.reshard.planner import Plan, build_plan
from verl_patches.reshard.shards import (allocate, full_state, logical_state, rollout_shards,
                                         torch_dtype, train_shards)


def check_plan(rank: int, plan: Plan, methods: tuple[str, ...] = METHODS, seed: int = 0,
               device: Any = "cpu") -> dict[str, Any]:
    """Returns {"plan": this rank's planned stats, method: {"mismatch": [names], ...}}.
    Rollout buffers start as NaN so that an element nobody writes shows as a mismatch.
    With "direct" among the methods, it also runs as "direct@3": three buckets in flight
    instead of two (the executor's ``in_flight``), which must give the same bits."""
    P = plan.placements
    logical = logical_state(P, full_state(P, seed=seed, dtype=plan.dtype))
    mine = train_shards(P, rank, logical, device=device)
    want = rollout_shards(P, rank, logical, device=device)
    out: dict[str, Any] = {"plan": vars(plan.ranks[rank]).copy()}
    if P.train.expert_storage != "grouped":  # the baselines emulate GroupedMLP storage only
        methods = tuple(m for m in methods if m == "direct")
    runs = [(m, m, 2) for m in methods] + ([("direct@3", "direct", 3)] if "direct" in methods else [])
    for name, method, in_flight in runs:
        got = allocate(P.rollout_storage[rank], torch_dtype(plan.dtype), device, fill=float("nan"))
        before = {n: v.clone() for n, v in mine.items()}
        st = execute(plan, rank, mine, got, method=method, in_flight=in_flight)
        bad = sorted(n for n in want if not torch.equal(got[n], want[n]))
        untouched = all(torch.equal(before[n], mine[n]) for n in mine)
        out[name] = {"mismatch": bad, "train_unchanged": untouched,
                       "stats": {k: v for k, v in vars(st).items() if k != "extra"}}
    return out


def check_plans(rank: int, world: int, plans: list[Plan], methods: tuple[str, ...] = METHODS) -> list[dict[str, Any]]:
    """check_plan for each plan (built once by the caller and shipped to every rank, so the
    ranks need no megatron import); for run_distributed."""
    return [check_plan(rank, plan, methods) for plan in plans]


def make_plan(model: dict[str, Any], train: str, rollout: str, dtype: str = "bfloat16",
              bucket_bytes: int = 4096) -> Plan:
    P = build_placements(ModelConfig.from_hf(model), TrainLayout.parse(train), RolloutLayout.parse(rollout))
    return build_plan(P.model, P.train, P.rollout, bucket_bytes=bucket_bytes, dtype=dtype, placements=P)
