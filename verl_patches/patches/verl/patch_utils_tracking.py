"""The run's report: verl's tracker prints one line per step, refuses non-finite metrics, keeps a JSONL
record and ends with a summary (verl_patches/report.py).

Upstream: verl/utils/tracking.py:Tracking. RayPPOTrainer.fit builds one Tracking with the resolved
config and calls ``log(metrics, step)`` once per step and once for the validation before training;
the console backend prints the whole dict (60-odd keys) and a NaN goes by unremarked. We wrap
``__init__`` to attach a RunReport when the config carries the recipe's section, and ``log`` to pass
every step through it first: the switch's figures (sent by the sharding manager through verl's timing
dict) are renamed ``switch/...``, a NaN or infinite metric stops the run with its name, and the
loggers receive what the report returns. Without the recipe's section the tracker is upstream's.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

REPORT_ATTR = stash.attr("report")
RECIPE = ("actor_rollout_ref", "rollout", "recipe")


def _get(cfg: Any, *path: str) -> Any:
    for key in path:
        if cfg is None:
            return None
        cfg = cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)
    return cfg


def wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self, project_name, experiment_name, default_backend="console", config=None):
        original(self, project_name, experiment_name, default_backend, config)
        recipe = _get(config, *RECIPE)
        if recipe is None:
            return
        from verl_patches.report import RunReport

        from verl_patches import settings

        metrics_file = settings.read(recipe, "metrics_file")
        setattr(self, REPORT_ATTR, RunReport(
            total_steps=int(_get(config, "trainer", "total_training_steps") or 0),
            reuse_old_log_prob=_get(config, "actor_rollout_ref", "actor", "recompute_old_log_prob") is False,
            metrics_file=Path(metrics_file) if metrics_file else None))

    return __init__


def wrap_log(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def log(self, data, step, backend=None):
        report = getattr(self, REPORT_ATTR, None)
        if report is not None:
            data = report.step(data, step)
        return original(self, data, step, backend)

    return log


_COMMON = dict(kind="wrap", phases=("driver",), upstream="verl", versions="==0.4.1",
               flag="actor_rollout_ref.rollout.recipe (present: report on; recipe.metrics_file: JSONL path)",
               remove_when="verl's tracker validates metrics and its trainer prints a compact per-step line.")

PATCHES = [
    Patch(
        feature="observability",
        id="verl.tracking.report_init",
        target="verl.utils.tracking:Tracking.__init__",
        fingerprint=Fingerprint("def __init__(self, project_name, experiment_name, default_backend: Union[str, "
                                "List[str]]='console', config=None)", "42d69ed13fdfda1b"),
        replacement=f"{__name__}:wrap_init",
        why="The report needs the run's settings (steps, reuse, metrics file), which only the tracker's "
            "constructor receives.",
        **_COMMON,
    ),
    Patch(
        feature="observability",
        id="verl.tracking.report",
        target="verl.utils.tracking:Tracking.log",
        fingerprint=Fingerprint("def log(self, data, step, backend=None)", "67d78900cdce5f62"),
        replacement=f"{__name__}:wrap_log",
        why="A NaN metric (e.g. a loss) makes every later number of the run wrong and verl logs it without a word; "
            "a user needs one readable line per step with the switch's cost, and a summary at the end.",
        **_COMMON,
    ),
]
