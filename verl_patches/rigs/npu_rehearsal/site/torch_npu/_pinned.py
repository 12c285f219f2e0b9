"""STAND-IN: page-locked ("pinned") host memory, as torch_npu provides it, answered on the host.

The real torch_npu registers the NPU's hooks with torch (C++: ``RegisterPrivateUse1HooksInterface``) and a
pinned host allocator; after it renamed the PrivateUse1 backend to ``npu``, torch asks those hooks whenever a
host tensor is pinned or asked whether it is (``Tensor.is_pinned``, ``Tensor.pin_memory``, a factory with
``pin_memory=True``). Python cannot register them on torch 2.5, so without this module each of those calls
raises ``Please register PrivateUse1HooksInterface`` (megatron-core's dist-checkpoint load asks ``is_pinned`` of
every tensor it reads; the overlay's offload pool makes its buffers with ``torch.empty(pin_memory=True)``).

What it does instead: pinning makes a host copy (as torch_npu does) and remembers its storage; ``is_pinned``
answers whether a tensor's storage is one of those (views of a pinned tensor are pinned, as on the NPU). What it
cannot stand for: page locking itself (DMA, the speed of non_blocking copies), which only the NPU has.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

# Storages made pinned here. A storage's Python object lives as long as its memory does (torch keeps it for
# the C++ storage), so the weak set forgets a storage exactly when its memory is freed.
_PINNED: "weakref.WeakSet[torch.UntypedStorage]" = weakref.WeakSet()
FACTORIES = ("empty", "empty_like", "empty_strided", "zeros", "ones", "full", "tensor")
_state = {"installed": False}


def _mark(t: torch.Tensor) -> torch.Tensor:
    _PINNED.add(t.untyped_storage())
    return t


def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    """``Tensor.is_pinned``: whether this host tensor's memory was pinned (by pin_memory or a pinned factory)."""
    return self.device.type == "cpu" and self.untyped_storage() in _PINNED


def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    """``Tensor.pin_memory``: the tensor itself where already pinned, else a pinned host copy (an error for a
    device tensor, as in torch)."""
    if self.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
    if is_pinned(self):
        return self
    return _mark(self.clone(memory_format=torch.contiguous_format))


def _pinned_factory(name: str, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(real)
    def factory(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        out = real(*args, **kwargs)
        if pin_memory:
            if out.device.type != "cpu":
                raise RuntimeError(f"torch.{name}(pin_memory=True): only host tensors can be pinned, not "
                                   f"{out.device}")
            _mark(out)
        return out

    factory.__stand_in__ = True  # type: ignore[attr-defined]
    return factory


def install() -> None:
    """Answer pinning on the host (idempotent; the torch_npu stand-in calls it at import)."""
    if _state["installed"]:
        return
    torch.Tensor.is_pinned = is_pinned  # type: ignore[method-assign]
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    for name in FACTORIES:
        setattr(torch, name, _pinned_factory(name, getattr(torch, name)))
    _state["installed"] = True
