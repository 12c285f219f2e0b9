"""A float64 all-reduce on Ascend returns its result to the caller's tensor.

Upstream: mindspeed/core/megatron_basic/requirements_basic.py:torch_all_reduce_double_dtype_bypass_wrapper
(MindSpeed v2.2.0_core_r0.12.1), which MindSpeed's megatron_basic feature wraps around
``torch.distributed.all_reduce`` (its torch_adaptation). For a float64 tensor it reduces a float32 copy (HCCL's
all-reduce takes no float64) and then converts that copy back into a new tensor that nobody holds: the caller's
tensor keeps this rank's own values, with no error. It also reads the tensor as ``args[0]``, so a call that
names it (``all_reduce(tensor=t)``) fails with an IndexError. Found by the NPU rehearsal's tiny run: the host's timing
average (a float64 SUM) showed each switch figure divided by the number of ranks.

Ours reduces the same float32 copy and copies the result into the caller's tensor (float64 again, rounded to
float32 on the way, as upstream intends), whether the tensor is passed by position or by name. Every other dtype goes to the wrapped all-reduce unchanged, as upstream.
Applied before MindSpeed's adaptor (verl_patches/entry_points.py: the records on MindSpeed come first), which
imports this factory when it registers its features.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def torch_all_reduce_double_dtype_bypass_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (torch.distributed.all_reduce) with float64 tensors reduced as float32 and the result written back."""
    import torch  # at call time: the doctor reads the catalogue in a Python that may have no torch

    @functools.wraps(fn)
    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        positional = bool(args)
        tensor = args[0] if positional else kwargs.get("tensor")
        if not (torch.is_tensor(tensor) and tensor.dtype == torch.float64):
            return fn(*args, **kwargs)
        as_float = tensor.float()
        if positional:
            handle = fn(as_float, *args[1:], **kwargs)
        else:
            handle = fn(**{**kwargs, "tensor": as_float})
        if handle is not None:
            handle.wait()
        tensor.copy_(as_float)
        return None  # as upstream: the reduction has finished (an async_op caller gets no handle to wait on)

    return all_reduce


PATCHES = [
    Patch(
        feature="model_layout",
        id="mindspeed.float64_all_reduce_returns",
        target="mindspeed.core.megatron_basic.requirements_basic:torch_all_reduce_double_dtype_bypass_wrapper",
        kind="replace",
        phases=("worker",),
        upstream="mindspeed",
        versions="==0.12.1",
        fingerprint=Fingerprint(signature="def torch_all_reduce_double_dtype_bypass_wrapper(fn)",
                                source_sha="a6ad54655322028d"),
        replacement=f"{__name__}:torch_all_reduce_double_dtype_bypass_wrapper",
        flag="always on (Ascend: every float64 torch.distributed.all_reduce)",
        why="MindSpeed's all-reduce wrapper reduces a float32 copy of a float64 tensor and drops the result: the "
            "caller's tensor keeps this rank's values, silently.",
        remove_when="MindSpeed's wrapper copies the reduced values back (or HCCL reduces float64 and the wrapper "
                    "goes).",
        upstream_ref="MindSpeed v2.2.0_core_r0.12.1 mindspeed/core/megatron_basic/requirements_basic.py",
        platforms=("npu",),
    ),
]
