"""Route ``data_source=deepscaler`` to the recipe's rule reward inside verl's default scorer.

Upstream: verl/utils/reward_score/__init__.py:default_compute_score dispatches on
data_source and raises NotImplementedError for sources it does not know, deepscaler among
them. We wrap it: deepscaler rows go to verl_patches.reward.deepscaler.compute_score, every
other source reaches the original unchanged. verl's reward managers (naive, prime, dapo)
and trainer/ppo/reward.py bind the function by ``from ... import``; the prelude rebinds them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.reward import DEEPSCALER_SOURCES
from verl_patches.reward.deepscaler import compute_score


def wrap_default_compute_score(original: Callable[..., Any]) -> Callable[..., Any]:
    # Every call upstream accepts must still work: verl's own _default_compute_score passes all seven
    # of upstream's arguments positionally (sandbox_fusion_url, concurrent_semaphore, memory_limit_mb),
    # so the trailing ones travel on as they came (tests/core/test_call_shapes.py checks the shape).
    @functools.wraps(original)
    def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, *args, **kwargs):
        if data_source in DEEPSCALER_SOURCES:
            # The sandbox arguments are for code data sets; a boxed math answer needs none of them.
            return compute_score(data_source, solution_str, ground_truth, extra_info)
        return original(data_source, solution_str, ground_truth, extra_info, *args, **kwargs)

    return default_compute_score


PATCHES = [
    Patch(
        feature="reward",
        id="verl.reward_score.deepscaler",
        target="verl.utils.reward_score:default_compute_score",
        kind="wrap",
        phases=("driver", "worker"),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(
            signature="def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, "
                      "sandbox_fusion_url=None, concurrent_semaphore=None, memory_limit_mb=None)",
            source_sha="8159ca9ff3e15212",
        ),
        replacement=f"{__name__}:wrap_default_compute_score",
        flag="data.train_files rows with data_source=deepscaler (no switch needed: other sources are untouched)",
        why="verl 0.4.1's default scorer has no deepscaler entry and raises NotImplementedError; the recipe "
            "trains on deepscaler with a boxed-answer rule reward (docs/DESIGN.md section 7).",
        remove_when="verl's default_compute_score dispatches deepscaler to an equivalent math-verify based "
                    "scorer, or the recipe config points custom_reward_function at the reward module instead.",
    ),
]
