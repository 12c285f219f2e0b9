"""The recipe's features: every patch record belongs to exactly one (``Patch.feature``).

docs/PATCHES.md is rendered by feature, in this order (the recipe's, then the CPU platform's); the
one-line summaries are what a reader sees above each group.
"""

from __future__ import annotations

FEATURES: dict[str, str] = {
    "model_layout": "DeepSeek-V3 on Megatron: the recipe's config, uneven pipeline stages, optimizer settings.",
    "reshard": "Train-to-rollout weight resharding into vLLM's own parameters.",
    "switch": "The train/rollout switch: offload, onload and release in one schedule.",
    "graph_safe_switch": "Address-stable memory regions so captured graphs survive the switch.",
    "rollout_engine": "The rollout engine built from the recipe, and torch.compile for the rollout.",
    "dp_domain": "vLLM data parallelism inside the training job's process groups.",
    "fixed_routing": "Load-balanced expert routing for benchmarks (random-init runs).",
    "old_log_prob_reuse": "Skipping the old log-prob forward when the policy has not moved.",
    "tensor_cache": "The driver-side tensor cache that keeps batches on the workers.",
    "checkpoint": "Checkpoint save and resume that restore the run bit for bit; checkpoints whole or absent.",
    "reward": "The recipe's reward functions.",
    "observability": "The recipe's per-step report.",
    "self_check": "Every step proves itself: the rollout's weights against the trainer's, captured addresses.",
    # Last: not the recipe's (verl_patches/rigs/cpu/patches/).
    "cpu_platform": "Host stand-ins for what has no CPU implementation upstream (CPU platform only).",
}


class UnknownFeature(ValueError):
    pass


def check_feature(name: str) -> str:
    if name not in FEATURES:
        raise UnknownFeature(f"feature {name!r} is not one of {sorted(FEATURES)} (verl_patches/core/features.py)")
    return name
