"""STAND-IN: ``Tensor.type()`` answered as torch_npu answers it for a tensor on the NPU.

The real torch_npu names a device tensor's type ``torch.npu.<Scalar>Tensor`` (its C++ tensor methods), and
MindSpeed's adaptor then rewrites ``npu`` to ``cuda`` in that string (``torch_adaptation``: ``type_wrapper``), so
megatron-core's optimizers, which accept only ``torch.cuda.*Tensor`` parameters, take the NPU's. On the rehearsal
platform the device's tensors are host tensors (``torch_npu.npu.TENSOR_DEVICE_TYPE``), whose own answer,
``torch.<Scalar>Tensor``, megatron refuses. So, with no argument, a dense host tensor answers as a device tensor,
except pinned host memory (``_pinned``), which is host memory on an NPU too. With a target type (a conversion)
torch's own method runs.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_npu import _pinned

_state = {"installed": False}


def install() -> None:
    """Answer ``Tensor.type()`` as on the NPU (idempotent; the torch_npu stand-in calls it at import)."""
    if _state["installed"]:
        return
    host_type = torch.Tensor.type

    def type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:  # noqa: A001
        if dtype is not None or non_blocking or kwargs:
            return host_type(self, dtype, non_blocking, **kwargs)
        name = host_type(self)
        if self.device.type == "cpu" and self.layout == torch.strided and not _pinned.is_pinned(self):
            return "torch.npu." + name[len("torch."):]
        return name

    type.__stand_in__ = True  # type: ignore[attr-defined]
    torch.Tensor.type = type  # type: ignore[method-assign]
    _state["installed"] = True
