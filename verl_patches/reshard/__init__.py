"""Reshard engine: move the just-trained weights from the Megatron training layout to the vLLM
rollout layout, by direct slice routing (plus the two reference methods, for comparison).

Public API: build_plan (metadata only), execute (one rank, any method), plan_summaries (all
methods' costs), and the shard builders used by tests and preflight. Names are loaded on first
use (PEP 562).

The modules: the metadata (``model``: the sizes; ``layouts``; ``coords``: rank coordinates; ``placements``;
``box``: region arithmetic; ``deepseek_v3_names``), the planner (``planner``; ``cli``: ``python -m verl_patches
plan``), the methods (``direct``: ours; ``alltoallv``: the reference recipe's; ``baselines``: verl 0.4.1's), their
copies and figures (``copyops``, ``stats``), the weight update's owner (``weight_sync``), live models (``binding``),
the proof (``checksum`` and its Triton ``fingerprint_kernel``; ``faults``: test-only injection), FP8 block
quantisation (``fp8_block`` and its ``fp8_block_kernel``) and the ground truth (``shards``).

The reshard methods' names (METHODS, what the recipe's `reshard_method` key, the preflight's `--method` and the
benchmarks accept) are declared beside their setting, in verl_patches/config/settings.py.
"""

from __future__ import annotations

from verl_patches import lazy_names

_WHERE = {
    "ExecStats": "verl_patches.reshard.stats",
    "execute": "verl_patches.reshard.weight_sync",
    **dict.fromkeys(["WeightSync", "for_method"], "verl_patches.reshard.weight_sync"),
    **dict.fromkeys(["LayoutError", "ModelConfig"], "verl_patches.reshard.model"),
    **dict.fromkeys(["RolloutLayout", "TrainLayout"], "verl_patches.reshard.layouts"),
    **dict.fromkeys(["Placements", "build_placements"], "verl_patches.reshard.placements"),
    **dict.fromkeys(["Plan", "RankStats", "build_plan"], "verl_patches.reshard.planner"),
    **dict.fromkeys(["full_state", "logical_state", "rollout_shards", "train_shards"], "verl_patches.reshard.shards"),
    "plan_summaries": "verl_patches.reshard.weight_sync",
}

__all__, __getattr__, __dir__ = lazy_names(__name__, _WHERE)
