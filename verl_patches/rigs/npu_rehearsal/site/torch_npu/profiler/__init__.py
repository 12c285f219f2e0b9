"""STAND-IN for ``torch_npu.profiler`` (NPU rehearsal platform): the part of torch_npu's profiler API that the
overlay's accelerator facade calls (verl_patches/base/accelerator.py, ``profiler``), onto torch's profiler on the
host, where the rehearsal's device work runs.

Declared answers:
- ``profile(activities, schedule, on_trace_ready, record_shapes, profile_memory, with_stack, with_modules,
  with_flops, experimental_config)`` (torch_npu's documented signature): torch.profiler.profile over the host;
  ``ProfilerActivity.NPU`` records the host too (the stand-in's device is the host). ``experimental_config`` must
  be this module's ``_ExperimentalConfig``: its profiler level chooses how much msprof collects on an NPU, which
  the host does not have, so it is kept (``level``), not applied;
- ``tensorboard_trace_handler(dir_name, worker_name=None, use_gzip=False)``: torch's, so the session writes a
  chrome trace ``<worker_name>.<ms>.pt.trace.json[.gz]`` where torch_npu writes its ``*_ascend_pt`` folder (which
  only an NPU's collected data fills);
- ``ProfilerActivity`` (CPU, NPU), ``ProfilerLevel`` (Level0, Level1, Level2) and
  ``_ExperimentalConfig(profiler_level=...)``.
Any other name raises AttributeError naming it; an argument torch_npu does not document is torch's TypeError.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Iterable, Optional

import torch

from verl_patches.rigs import npu_rehearsal as _platform


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


class ProfilerLevel:
    Level0 = "Level0"
    Level1 = "Level1"
    Level2 = "Level2"


class _ExperimentalConfig:
    """The profiler level only (torch_npu's other experimental options are not stood in for)."""

    def __init__(self, profiler_level: str = ProfilerLevel.Level0) -> None:
        if profiler_level not in (ProfilerLevel.Level0, ProfilerLevel.Level1, ProfilerLevel.Level2):
            raise ValueError(f"torch_npu.profiler._ExperimentalConfig: profiler_level {profiler_level!r} is not a "
                             "ProfilerLevel (Level0, Level1, Level2)")
        self.level = profiler_level


def tensorboard_trace_handler(dir_name: str, worker_name: Optional[str] = None,
                              use_gzip: bool = False) -> Callable[[Any], None]:
    return torch.profiler.tensorboard_trace_handler(dir_name, worker_name=worker_name, use_gzip=use_gzip)


def profile(activities: Optional[Iterable[ProfilerActivity]] = None, schedule: Any = None,
            on_trace_ready: Optional[Callable[[Any], None]] = None, record_shapes: bool = False,
            profile_memory: bool = False, with_stack: bool = False, with_modules: bool = False,
            with_flops: bool = False, experimental_config: Optional[_ExperimentalConfig] = None) -> Any:
    if experimental_config is not None and not isinstance(experimental_config, _ExperimentalConfig):
        raise TypeError(f"torch_npu.profiler.profile: experimental_config must be a "
                        f"torch_npu.profiler._ExperimentalConfig, got {type(experimental_config).__name__}")
    given = list(activities) if activities is not None else list(ProfilerActivity)
    unknown = [a for a in given if not isinstance(a, ProfilerActivity)]
    if unknown:
        raise TypeError(f"torch_npu.profiler.profile: activities must be torch_npu.profiler.ProfilerActivity "
                        f"members, got {unknown}")
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                  on_trace_ready=on_trace_ready, record_shapes=record_shapes,
                                  profile_memory=profile_memory, with_stack=with_stack, with_modules=with_modules,
                                  with_flops=with_flops)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise _platform.missing_operator(f"torch_npu.profiler.{name}")
