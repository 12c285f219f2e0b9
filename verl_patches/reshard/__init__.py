"""Reshard engine: move the just-trained weights from the Megatron training layout to the vLLM
rollout layout, by direct slice routing (plus the two reference methods, for comparison).

Public API: build_plan (metadata only), execute (one rank, any method), plan_summaries (all
methods' costs), and the shard builders used by tests and preflight. Names are loaded on first
use (PEP 562), so that `verl_patches.reshard.methods` is read without torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "METHODS": "verl_patches.reshard.methods",
    "ExecStats": "verl_patches.reshard.stats",
    "execute": "verl_patches.reshard.executor",
    **dict.fromkeys(["LayoutError", "ModelConfig"], "verl_patches.reshard.model"),
    **dict.fromkeys(["RolloutLayout", "TrainLayout"], "verl_patches.reshard.layouts"),
    **dict.fromkeys(["Placements", "build_placements"], "verl_patches.reshard.placements"),
    **dict.fromkeys(["Plan", "RankStats", "build_plan"], "verl_patches.reshard.planner"),
    **dict.fromkeys(["full_state", "logical_state", "rollout_shards", "train_shards"], "verl_patches.reshard.shards"),
    "plan_summaries": "verl_patches.reshard.summary",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
