"""STAND-IN for ``torch_npu._C._distributed_c10d`` (NPU rehearsal platform): HCCL process-group options.

MindSpeed and MindSpeed-LLM build ``ProcessGroupHCCL.Options`` and put an ``hccl_config`` dict in it (group
name for the profiler, buffer sizes) before creating each group. The host's groups are gloo groups
(transfer_to_npu maps the backend): the stand-in's ``new_group`` drops these options, which configure HCCL
only; nothing else reads them.
"""

from __future__ import annotations

from typing import Any

from verl_patches.rigs import npu_rehearsal as _platform


class ProcessGroupHCCL:
    class Options:
        def __init__(self) -> None:
            self._hccl_config: dict[str, Any] = {}

        @property
        def hccl_config(self) -> dict[str, Any]:
            return dict(self._hccl_config)  # a copy, as torch_npu's binding returns one (no in-place update)

        @hccl_config.setter
        def hccl_config(self, value: dict[str, Any]) -> None:
            self._hccl_config = dict(value)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise _platform.missing_operator(f"torch_npu._C._distributed_c10d.{name}")
