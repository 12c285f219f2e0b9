"""Reshard engine: move the just-trained weights from the Megatron training layout to the vLLM
rollout layout, by direct slice routing (plus the two reference methods, for comparison).

Public API: build_plan (metadata only), execute (one rank, any method), plan_summaries (all
methods' costs), and the shard builders used by tests and preflight. Names are loaded on first
use (PEP 562), so that the reshard methods' names (METHODS, what the recipe's `reshard_method` key,
the preflight's `--method` and the benchmarks accept) are read without torch.distributed.
"""

from __future__ import annotations

from verl_patches import lazy_names

# name -> what it is; the executors live in verl_patches.reshard.executor (direct) and
# verl_patches.reshard.baselines (the two references, for comparison).
METHOD_DOCS: dict[str, str] = {
    "direct": "ours: direct slice routing, one all-to-all per bucket, no full tensor materialised",
    "recipe": "the published recipe's reference: experts by a PP broadcast and one AlltoAllV in the expert group; "
              "dense tensors by a TP all-gather to full size and a PP all-to-all of them to every stage",
    "upstream": "verl 0.4.1's path: every parameter gathered to full size on every rank",
}
METHODS: tuple[str, ...] = tuple(METHOD_DOCS)


def check_method(name: str) -> str:
    if name not in METHODS:
        raise ValueError(f"reshard method {name!r}: expected one of {METHODS}")
    return name


_WHERE = {
    "ExecStats": "verl_patches.reshard.baselines",
    "execute": "verl_patches.reshard.executor",
    **dict.fromkeys(["LayoutError", "ModelConfig"], "verl_patches.reshard.model"),
    **dict.fromkeys(["RolloutLayout", "TrainLayout"], "verl_patches.reshard.layouts"),
    **dict.fromkeys(["Placements", "build_placements"], "verl_patches.reshard.placements"),
    **dict.fromkeys(["Plan", "RankStats", "build_plan"], "verl_patches.reshard.planner"),
    **dict.fromkeys(["full_state", "logical_state", "rollout_shards", "train_shards"], "verl_patches.reshard.shards"),
    "plan_summaries": "verl_patches.reshard.baselines",
}

__all__, __getattr__, __dir__ = lazy_names(__name__, _WHERE)
