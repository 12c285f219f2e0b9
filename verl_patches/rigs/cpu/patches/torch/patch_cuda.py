"""torch.cuda's device, synchronisation and stream calls answered by the host (CPU platform only).

Upstream: torch/cuda/__init__.py (torch 2.5.1). megatron-core 0.12.1 calls ``torch.cuda.current_device()``
to place every buffer it allocates, ``torch.cuda.synchronize()`` around its pipeline and checkpoint
code, and ``torch.cuda.current_stream()`` / ``torch.cuda.stream(...)`` in its MoE dispatcher and shared
experts, whatever the device. Without a GPU each call raises. On the CPU platform the host is the
one device and program order the one stream (verl_patches/rigs/cpu/cuda_runtime.py). Never applied on
NPU or CUDA; ``torch.cuda.is_available()`` keeps answering False.
"""

from __future__ import annotations

import contextlib

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch



def current_device():
    return "cpu"


def synchronize(device=None):
    return None


def current_stream(device=None):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.rigs.cpu.cuda_runtime import HOST_STREAM

    return HOST_STREAM


def stream(stream):
    return contextlib.nullcontext()

_WHY = ("The recipe's loop runs on a machine without an accelerator (the tiny run in CI); megatron-core asks "
        "torch.cuda for {what} whatever the device, which raises without a GPU.")
_REMOVE = "megatron-core takes its device and streams from an accelerator abstraction instead of torch.cuda."


def _record(name: str, signature: str, sha: str, what: str) -> Patch:
    return Patch(feature="cpu_platform", id=f"cpu.torch.cuda_{name}", target=f"torch.cuda:{name}", kind="replace", phases=("worker",),
                 upstream="torch", versions="==2.5.1", fingerprint=Fingerprint(signature, sha),
                 replacement=f"{__name__}:{name}", flag="the CPU platform (no accelerator)",
                 why=_WHY.format(what=what), remove_when=_REMOVE, platforms=("cpu",))


PATCHES = [
    _record("current_device", "def current_device() -> int", "1248b14f580d7b95",
            "the device to allocate on (the host here)"),
    _record("synchronize", "def synchronize(device: _device_t=None) -> None", "9db8317ed708485b",
            "a device synchronisation (host work is in program order)"),
    _record("current_stream", "def current_stream(device: Optional[_device_t]=None) -> Stream", "17083d7b7ad0d0c4",
            "the current stream (the program order here)"),
    _record("stream", "def stream(stream: Optional['torch.cuda.Stream']) -> StreamContext", "a2952b3d7f5a9d3c",
            "a stream context (nothing to switch here)"),
]
