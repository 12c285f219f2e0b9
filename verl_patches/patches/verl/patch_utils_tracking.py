"""The run's report: verl's tracker prints one line per step, refuses non-finite metrics, keeps a JSONL
record, adds the throughput per card, flushes tensorboard every step and ends with a summary
(verl_patches/reporting/report.py).

Upstream: verl/utils/tracking.py:Tracking. RayPPOTrainer.fit builds one Tracking with the resolved
config and calls ``log(metrics, step)`` once per step and once for the validation before training;
the console backend prints the whole dict (60-odd keys) and a NaN goes by unremarked. We wrap
``__init__`` to attach a RunReport when the config carries the recipe's section (with
``recipe.tensorboard_dir`` set, verl's tensorboard logger is told that directory through its
TENSORBOARD_DIR before it is built), and ``log`` to pass every step through it first: the switch's
figures (sent by the sharding manager through verl's timing dict) are renamed ``switch/...``,
``perf/tps_per_card`` is added, a NaN or infinite metric stops the run with its name, and the other
loggers receive what the report returns. The report's line replaces verl's console dump (every metric
is in the JSONL record and tensorboard), and tensorboard's writer is flushed after each step: verl
never closes it, and its writer flushes only every two minutes, so a short run would end with an
empty event file. Without the recipe's section the tracker is upstream's.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.config import settings
from verl_patches.reporting.report import Cards, RunReport

REPORT_ATTR = stash.attr("report")


def _get(cfg: Any, *path: str) -> Any:
    return settings.lookup(cfg, ".".join(path))


def wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self, project_name, experiment_name, default_backend="console", config=None):
        recipe = settings.trainer_section(config)
        if recipe is None:
            return original(self, project_name, experiment_name, default_backend, config)
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.base import accelerator

        # Upstream's __del__ reads self.logger: a setting refused below must not add an AttributeError to it.
        self.logger = {}
        # Read (and checked) before verl builds its loggers: a wrong setting stops the run here.
        run = settings.build(recipe)
        metrics_file, tb_dir = run.metrics_file, run.tensorboard_dir
        devices = int(_get(config, "trainer", "nnodes") or 1) * int(_get(config, "trainer", "n_gpus_per_node") or 1)
        cards = Cards.of(devices, _get(config, "trainer", "device"), accelerator.device_type(), run.devices_per_card)
        backends = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        if tb_dir:
            os.environ["TENSORBOARD_DIR"] = str(tb_dir)
        original(self, project_name, experiment_name, default_backend, config)
        if "tensorboard" in backends:
            tb_dir = os.path.abspath(os.environ.get("TENSORBOARD_DIR",
                                                    f"tensorboard_log/{project_name}/{experiment_name}"))
        report = RunReport(
            total_steps=int(_get(config, "trainer", "total_training_steps") or 0),
            metrics_file=Path(metrics_file) if metrics_file else None, cards=cards,
            tensorboard_dir=tb_dir if "tensorboard" in backends else None)
        setattr(self, REPORT_ATTR, report)
        print(report.header(), file=report.out, flush=True)

    return __init__


def wrap_log(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def log(self, data, step, backend=None):
        report = getattr(self, REPORT_ATTR, None)
        if report is None:
            return original(self, data, step, backend)
        data = report.step(data, step)
        # The report printed the step's line: verl's console dump of every key is left out.
        others = [b for b in self.logger if b != "console" and (backend is None or b in backend)]
        out = original(self, data, step, others) if others else None
        writer = getattr(self.logger.get("tensorboard"), "writer", None)
        if writer is not None:
            writer.flush()
        return out

    return log


_COMMON = dict(kind="wrap", phases=("driver",), upstream="verl", versions="==0.4.1",
               flag="actor_rollout_ref.rollout.recipe (present: report on; recipe.metrics_file: JSONL path; "
                    "recipe.tensorboard_dir; recipe.devices_per_card)",
               remove_when="verl's tracker validates metrics, flushes tensorboard per step and its trainer prints a "
                           "compact per-step line with the throughput per card.")

PATCHES = [
    Patch(
        feature="observability",
        id="verl.tracking.report_init",
        target="verl.utils.tracking:Tracking.__init__",
        fingerprint=Fingerprint("def __init__(self, project_name, experiment_name, default_backend: Union[str, "
                                "List[str]]='console', config=None)", "42d69ed13fdfda1b"),
        replacement=f"{__name__}:wrap_init",
        why="The report needs the run's settings (steps, reuse, metrics file, devices and cards, tensorboard "
            "directory), which only the tracker's constructor receives.",
        **_COMMON,
    ),
    Patch(
        feature="observability",
        id="verl.tracking.report",
        target="verl.utils.tracking:Tracking.log",
        fingerprint=Fingerprint("def log(self, data, step, backend=None)", "67d78900cdce5f62"),
        replacement=f"{__name__}:wrap_log",
        why="A NaN metric (e.g. a loss) makes every later number of the run wrong and verl logs it without a word; "
            "a user needs one readable line per step with the switch's cost and the throughput per card, curves "
            "that are on disk while the run goes (verl never flushes tensorboard), and a summary at the end.",
        **_COMMON,
    ),
]
