"""Reshard engine: move the just-trained weights from the Megatron training layout to the vLLM
rollout layout, by direct slice routing (plus the two reference methods, for comparison).

Public API: build_plan (metadata only), execute (one rank, any method), plan_summaries (all
methods' costs), and the shard builders used by tests and preflight.
"""

from verl_patches.reshard.executor import METHODS, ExecStats, execute
from verl_patches.reshard.layout import (LayoutError, ModelConfig, Placements, RolloutLayout,
                                         TrainLayout, build_placements)
from verl_patches.reshard.planner import Plan, RankStats, build_plan
from verl_patches.reshard.shards import full_state, logical_state, rollout_shards, train_shards
from verl_patches.reshard.summary import plan_summaries

__all__ = ["METHODS", "ExecStats", "LayoutError", "ModelConfig", "Placements", "Plan", "RankStats",
           "RolloutLayout", "TrainLayout", "build_placements", "build_plan", "execute", "full_state",
           "logical_state", "plan_summaries", "rollout_shards", "train_shards"]
