"""Profiles of chosen stages (``recipe.profile``): one profiler session per stage of a chosen step on a chosen rank,
written to ``<dir>/step<N>/<stage>/rank<R>/`` through the accelerator facade (torch_npu's profiler on NPU, torch's
on CUDA and the CPU: verl_patches/base/accelerator.py, ``profiler``).

Where it binds: the worker calls that are stages are wrapped once already, by the switch's wrappers
(verl_patches/patches/verl/patch_workers_megatron_workers_switch.py: generate_sequences is ``rollout``,
compute_log_prob ``old_log_prob``, compute_ref_log_prob ``ref_log_prob``, update_actor ``update``); each runs its
call inside ``stage(name, step)``. The switch's phases are the steps of the switch loop
(verl_patches/offload/live.py, ``LiveSwitch._run``) that are not a stage's own work: each runs inside
``phase(name)``. The trainer's global step comes with each call (the driver puts it in the batch's meta_info:
patch verl.self_check.step_to_workers); a validation generation carries none and is not profiled.

Sessions never nest (one profiler at a time in a process): inside a stage's session a switch phase, or a stage
called from another, is a named range of that session's trace (``recipe/<stage>``, ``recipe/switch/<phase>``);
a switch phase outside any session opens a session of its own when ``switch`` is chosen, one per phase
(``rank<R>_<phase>`` in the step's switch/rank<R>/ folder).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional

from verl_patches.base import accelerator

LABEL = "recipe/"  # the prefix of the ranges this module names in a trace


class Profiles:
    """The process's profiling: ``settings`` (the run's ProfileSettings, verl_patches/config/settings.py; None:
    off) for the worker of global ``rank``. ``written``: the folders of the sessions written so far."""

    def __init__(self, settings: Any = None, rank: int = 0) -> None:
        self.settings = settings
        self.rank = rank
        self.step: Optional[int] = None  # the trainer's global step of the stage call under way (or last made)
        self.recording: Optional[tuple[int, str]] = None  # (step, stage) of the session open now
        self.written: list[Path] = []

    def directory(self, step: int, stage: str) -> Path:
        return Path(self.settings.dir) / f"step{step}" / stage / f"rank{self.rank}"

    def _wants(self, stage: str, step: Any) -> bool:
        return self.settings is not None and self.settings.wants(stage, step, self.rank)

    @contextlib.contextmanager
    def stage(self, stage: str, step: Optional[int]) -> Iterator[None]:
        """A worker call of ``stage`` for the trainer's global ``step`` (None: no training step, a validation)."""
        self.step = step
        if self.recording is not None:
            with accelerator.profiler_label(f"{LABEL}{stage}"):
                yield
        elif self._wants(stage, step):
            with self._session(step, stage, f"{LABEL}{stage}", f"rank{self.rank}"):
                yield
        else:
            yield

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A phase of the switch (a step of the switch loop that is not a stage's own work), in the step of the
        stage call under way."""
        label = f"{LABEL}switch/{name}"
        if self.recording is not None:
            with accelerator.profiler_label(label):
                yield
        elif self._wants("switch", self.step):
            with self._session(self.step, "switch", label, f"rank{self.rank}_" + name.replace(":", "_")):
                yield
        else:
            yield

    @contextlib.contextmanager
    def _session(self, step: int, stage: str, label: str, worker_name: str) -> Iterator[None]:
        where = self.directory(step, stage)
        where.mkdir(parents=True, exist_ok=True)
        self.recording = (step, stage)
        try:
            with accelerator.profiler(str(where), worker_name, self.settings.level), accelerator.profiler_label(label):
                yield
        finally:
            self.recording = None
        self.written.append(where)


_PROCESS = Profiles()


def profiles() -> Profiles:
    """The process's profiling (off until ``configure``)."""
    return _PROCESS


def configure(settings: Any, rank: int) -> Profiles:
    """Profile as ``settings`` (the run's ProfileSettings) say, as the worker of global ``rank``; the workers of
    one process (the actor and the reference share one) configure it alike."""
    _PROCESS.settings = settings if settings is not None and settings.on else None
    _PROCESS.rank = int(rank)
    return _PROCESS


def stage(name: str, step: Optional[int]) -> Any:
    return _PROCESS.stage(name, step)


def phase(name: str) -> Any:
    return _PROCESS.phase(name)
