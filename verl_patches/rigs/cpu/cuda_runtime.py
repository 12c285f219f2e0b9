"""Host stand-ins for the CUDA runtime calls megatron-core makes whatever the device (CPU platform only).

megatron-core 0.12.1 asks ``torch.cuda`` for the current device, synchronises, seeds and forks the
CUDA RNG, opens a side stream for the MoE dispatcher's split sizes, and creates a few scalars with
``device='cuda'`` / ``.cuda()`` in its optimizers and pipeline schedules. On a machine without a GPU
each of these fails. On the host there is one device (the host), one stream (the program order)
and one generator (torch's default CPU generator, which is also what every CPU op draws from, so
megatron's RNG tracker keeps its meaning: a fork swaps the generator every op uses).

``CudaOnCpu`` is a torch-function mode, entered only around megatron-core's schedules and
optimizer (see the patch records): inside it a tensor asked for on ``cuda`` is made on the host,
and a host tensor answers ``.type()`` as its CUDA type, which megatron's optimizers check.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

class HostStream:
    """A stream that is the program order: waiting and synchronising are no-ops."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> "HostEvent":
        return event if event is not None else HostEvent()


class HostEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


HOST_STREAM = HostStream()
HOST = "cpu"


@contextlib.contextmanager
def host_stream_class() -> Iterator[None]:
    """``torch.cuda.Stream`` answers with a host stream for the duration (the MoE dispatcher builds
    one in its constructor). Not made permanent: torch._dynamo checks at import that
    torch.cuda.Stream is a real stream class."""
    saved = torch.cuda.Stream
    torch.cuda.Stream = lambda *args, **kwargs: HostStream()  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        torch.cuda.Stream = saved  # type: ignore[misc]


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, torch.device) and device.type == "cuda"


def _host(device: Any, *, index_means_cuda: bool) -> Any:
    if _is_cuda(device) or (index_means_cuda and isinstance(device, int) and not isinstance(device, bool)):
        return HOST
    return device


class CudaOnCpu(TorchFunctionMode):
    """Tensors asked for on CUDA are made on the host; host tensors report CUDA types to ``.type()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _host(kwargs["device"], index_means_cuda=True)}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = (args[0], *(_host(a, index_means_cuda=False) for a in args[1:]))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def on_host(fn):
    """``fn`` run under CudaOnCpu (a fresh mode per call: modes are per thread)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with CudaOnCpu():
            return fn(*args, **kwargs)

    return call
