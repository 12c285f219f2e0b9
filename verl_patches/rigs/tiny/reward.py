"""The tiny run's reward: the toy task scored here, every other data source by verl's default scorer.

Set as verl's ``custom_reward_function`` by configs/tiny_deepseek_v3.yaml. Rows of ``TOY_SOURCE``
score the share of digits among the answer's visible characters (0 for an empty answer); every
other row goes to ``verl.utils.reward_score.default_compute_score``, where the recipe's rule reward
scores deepscaler (patch verl.reward_score.deepscaler), as in the 256-die runs.
"""

from __future__ import annotations

from typing import Any

from verl_patches.rigs.tiny.assets import TOY_SOURCE


def digit_share(text: str) -> float:
    visible = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in visible) / len(visible) if visible else 0.0


def correct_answer(data_source: str, ground_truth: Any) -> str | None:
    """A full-score answer for the data check (python -m verl_patches.checks.data_check); None: a boxed one."""
    return "1234567890" if data_source == TOY_SOURCE else None


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> float:
    if data_source == TOY_SOURCE:
        return digit_share(solution_str)
    # Lazy: verl's scorer when a score is asked; verl imports this module by path while it loads.
    from verl.utils.reward_score import default_compute_score

    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
