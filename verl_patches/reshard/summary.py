"""Per-method cost summaries of one reshard (ours, upstream A, recipe B) from metadata alone:
what `python -m verl_patches plan` prints and preflight checks.
"""

from __future__ import annotations

from typing import Any

from verl_patches.reshard.baselines import recipe_stats, upstream_stats
from verl_patches.reshard.planner import Plan, summarize


def plan_summaries(plan: Plan) -> list[dict[str, Any]]:
    """One dict per method with max/mean received bytes per rank, total bytes on links,
    collectives per rank and peak extra device memory per rank."""
    P, es = plan.placements, plan.elem_size
    return [summarize("direct", plan.ranks), summarize("upstream", upstream_stats(P, es)),
            summarize("recipe", recipe_stats(P, es))]
