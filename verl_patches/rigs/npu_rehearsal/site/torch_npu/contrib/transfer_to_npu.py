"""STAND-IN for ``torch_npu.contrib.transfer_to_npu`` (NPU rehearsal platform).

The real module, imported once, makes CUDA code run on the NPU: ``torch.cuda``'s API answers with
``torch.npu``'s, a device asked for as ``cuda`` (or by bare index) is the NPU, and the ``nccl`` backend is
``hccl``. This one does the same onto the host the rehearsal runs on: ``torch.cuda``'s API answers with the
stand-in ``torch.npu`` (which answers with the host), a tensor or module asked for on ``cuda``, ``npu`` or a
bare device index is made or kept on the host, and ``nccl`` and ``hccl`` process groups are gloo groups (HCCL's own group options, which only configure
HCCL, are dropped).
As the real module does, it also turns ``torch.jit.script`` into a function that returns its argument
unscripted (TorchScript does not run on the NPU; MindSpeed then makes ``torch.compile`` that function too).
Only the names listed below are mapped; any other torch.cuda call keeps torch's own behaviour (which
raises without CUDA), so nothing unlisted is silently answered.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

import torch_npu  # noqa: F401  (registers torch.npu)
from torch_npu._C._distributed_c10d import ProcessGroupHCCL

# torch.cuda names answered by torch.npu (the stand-in module implements each).
CUDA_API = ("is_available", "is_initialized", "init", "device_count", "current_device", "set_device",
            "get_device_name", "get_device_properties", "synchronize", "Stream", "empty_cache", "memory_allocated",
            "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
            "reset_max_memory_allocated", "memory_stats", "mem_get_info", "Event", "current_stream",
            "default_stream", "stream", "manual_seed", "manual_seed_all", "seed", "initial_seed", "get_rng_state",
            "set_rng_state", "device", "is_current_stream_capturing")
# torch.cuda.random names answered by torch.npu (megatron-core reads the RNG state through torch.cuda.random).
CUDA_RANDOM_API = ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "seed", "initial_seed")
# torch functions that take a device= keyword: a cuda / npu / index device is the host.
FACTORIES = ("tensor", "as_tensor", "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones",
             "ones_like", "full", "full_like", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
             "randperm", "arange", "range", "linspace", "logspace", "eye", "normal", "tril_indices", "triu_indices")
TENSOR_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")
BACKENDS = {"nccl": "gloo", "hccl": "gloo"}
HOST = "cpu"


def _on_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.split(":")[0] in ("cuda", "npu")
    return isinstance(device, torch.device) and device.type in ("cuda", "npu")


def _host(device: Any) -> Any:
    return HOST if _on_device(device) else device


def _device_kwarg(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"])
        return fn(*args, **kwargs)

    call.__wrapped_by_transfer_to_npu__ = True  # type: ignore[attr-defined]
    return call


def _to(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple(_host(a) if isinstance(a, (str, int, torch.device)) and not isinstance(a, bool) else a
                     for a in args)
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"])
        return fn(self, *args, **kwargs)

    to.__wrapped_by_transfer_to_npu__ = True  # type: ignore[attr-defined]
    return to


def _stay(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``.cuda()`` / ``.npu()``: the host is the device, so the tensor or module stays where it is."""
    return self


def _backend(fn: Callable[..., Any], position: int) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs and isinstance(kwargs["backend"], str):
            kwargs["backend"] = BACKENDS.get(kwargs["backend"], kwargs["backend"])
        elif len(args) > position and isinstance(args[position], str):
            args = (*args[:position], BACKENDS.get(args[position], args[position]), *args[position + 1:])
        options = kwargs.get("pg_options")
        if options is not None and isinstance(options, ProcessGroupHCCL.Options):
            kwargs["pg_options"] = None  # HCCL's options (profiler group name, buffer sizes) configure HCCL only
        return fn(*args, **kwargs)

    call.__wrapped_by_transfer_to_npu__ = True  # type: ignore[attr-defined]
    return call


def jit_script(obj: Any, optimize: Any = None, _frames_up: int = 0, _rcb: Any = None,
               example_inputs: Any = None) -> Any:
    return obj  # as the real transfer_to_npu: the function runs unscripted


def _apply() -> None:
    if getattr(torch.empty, "__wrapped_by_transfer_to_npu__", False):
        return
    for name in CUDA_API:
        setattr(torch.cuda, name, getattr(torch.npu, name))
    for name in CUDA_RANDOM_API:
        setattr(torch.cuda.random, name, getattr(torch.npu, name))
    for name in FACTORIES:
        setattr(torch, name, _device_kwarg(getattr(torch, name)))
    for name in TENSOR_METHODS:
        setattr(torch.Tensor, name, _device_kwarg(getattr(torch.Tensor, name)))
    torch.Tensor.to = _to(torch.Tensor.to)
    torch.nn.Module.to = _to(torch.nn.Module.to)
    torch.Tensor.cuda = torch.Tensor.npu = _stay  # type: ignore[attr-defined]
    torch.nn.Module.cuda = torch.nn.Module.npu = _stay  # type: ignore[attr-defined]
    torch.jit.script = jit_script
    dist.init_process_group = _backend(dist.init_process_group, 0)
    dist.new_group = _backend(dist.new_group, 2)


_apply()
