"""STAND-IN for torch_npu (Ascend's PyTorch adapter), of the NPU rehearsal platform only.

Imported only through verl_patches.rigs.npu_rehearsal.activate() (VERL_PATCHES_PLATFORM=npu-rehearsal), never
where a real torch_npu is installed. What it does, as the real package does on import:
- renames torch's PrivateUse1 backend to ``npu`` and registers ``torch.npu`` (here: ``torch_npu.npu``, the
  device API answered by the host: see that module);
- answers pinned host memory (``pin_memory``, ``is_pinned``, ``pin_memory=True`` factories: see _pinned.py);
- answers ``Tensor.type()`` for the device's (host) tensors as ``torch.npu.<Scalar>Tensor`` (see _tensor_type.py);
- exposes ``torch_npu.profiler`` (the profiler API the accelerator facade calls, onto torch's: see that package);
- exposes torch_npu's operators (``torch_npu.npu_*``) as attributes: here the host implementations of
  verl_patches/rigs/npu_rehearsal (``OPERATORS`` of its ``ops`` package), looked up at each access; a name that
  is not there raises AttributeError naming it.
"""

from __future__ import annotations

import torch

from verl_patches.rigs import npu_rehearsal as _platform

if not _platform.selected():
    raise ImportError(f"this torch_npu is the NPU rehearsal platform's STAND-IN ({__file__}); it is used only with "
                      f"{_platform.ENV}={_platform.PLATFORM} (verl_patches.rigs.npu_rehearsal.activate())")

# Put first on PYTHONPATH by the launcher (DEVICE=npu-rehearsal), this package would shadow a real torch_npu:
# refuse, as activate() does.
if _platform.real_torch_npu_origin() is not None:
    raise ImportError(f"a real torch_npu is installed ({_platform.real_torch_npu_origin()}); the NPU rehearsal "
                      f"platform's stand-in ({__file__}) is never used beside it: unset {_platform.ENV} and take "
                      f"{_platform.SITE} off PYTHONPATH to run on the NPU")

__version__ = "rehearsal-stand-in"
STAND_IN = True
# torch_npu's list of the dtypes the NPU does not hold (the quantized ones); MindSpeed skips them when it
# enumerates torch's dtypes (mindspeed/core/multi_modal/dist_train/dist_communication.py).
unsupported_dtype = [torch.quint8, torch.quint4x2, torch.quint2x4, torch.qint32, torch.qint8]

if torch._C._get_privateuse1_backend_name() != "npu":
    torch.utils.rename_privateuse1_backend("npu")

# Renamed, torch asks the NPU's C++ hooks about pinned host memory; the stand-in answers on the host (_pinned.py).
from torch_npu import _pinned  # noqa: E402

_pinned.install()

from torch_npu import _tensor_type  # noqa: E402

_tensor_type.install()

from torch_npu import npu  # noqa: E402  (the device module; registered as torch.npu below)

if getattr(torch, "npu", None) is not npu:
    torch._register_device_module("npu", npu)

from torch_npu import _C, contrib  # noqa: E402,F401
from torch_npu import profiler  # noqa: E402,F401  (the real package imports its profiler: torch_npu.profiler)


def _hccl_on_host(store, rank, size, timeout):
    """The real torch_npu registers the ``hccl`` c10d backend at import (verl initialises its groups with it
    before anything imports transfer_to_npu); here an ``hccl`` group is a gloo group on the host."""
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)


if "hccl" not in torch.distributed.Backend.backend_list:
    torch.distributed.Backend.register_backend("hccl", _hccl_on_host, devices=["cpu"])


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    ops = _platform.operators()
    if name in ops:
        return ops[name]
    raise _platform.missing_operator(f"torch_npu.{name}")
