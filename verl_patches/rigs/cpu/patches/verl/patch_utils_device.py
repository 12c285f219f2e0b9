"""verl's device helpers on the CPU platform: gloo as the collective backend, the host as the device module.

Upstream: verl/utils/device.py. ``get_nccl_backend`` raises when neither CUDA nor NPU is available,
and ``get_torch_device`` returns ``torch.cpu``, which in torch 2.5.1 has no RNG state, memory
statistics or ``empty_cache``; verl's Megatron worker, sharding manager and checkpoint manager call
all of these. On the CPU platform the collective backend is gloo and the device module is the
accelerator facade's host module (verl_patches/base/accelerator.py: device_module). Never applied on NPU
or CUDA, where upstream's answers are already hccl / nccl and torch.npu / torch.cuda.
"""

from __future__ import annotations

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def get_nccl_backend() -> str:
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.base import accelerator

    return accelerator.dist_backend()


def get_torch_device():
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.base import accelerator

    return accelerator.device_module()


class HostDeviceId(str):
    """The host as verl's "device id": the string "cpu" as a device, formatted as its index 0.

    verl uses get_device_id() both as a device (``device=get_device_id()``, ``.to(get_device_id())``)
    and as an index (``f"{get_device_name()}:{get_device_id()}"`` in megatron_utils.get_model); on a
    GPU both read the int index. On the host the device is "cpu" and the index is 0.
    """

    def __format__(self, spec: str) -> str:
        return format(0, spec)


def get_device_id():
    return HostDeviceId("cpu")


_REMOVE = "verl's device helpers support a CPU device (gloo, a torch.cpu with the calls verl makes)."

PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.verl.dist_backend",
        target="verl.utils.device:get_nccl_backend",
        kind="replace",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint("def get_nccl_backend() -> str", "9ba0fcf1b9f9d0dd"),
        replacement=f"{__name__}:get_nccl_backend",
        flag="the CPU platform (no accelerator)",
        why="verl's Megatron worker initialises torch.distributed with get_nccl_backend(), which raises without "
            "CUDA or NPU; on the host the workers join over gloo.",
        remove_when=_REMOVE,
        platforms=("cpu",),
    ),
    Patch(
        feature="cpu_platform",
        id="cpu.verl.device_id",
        target="verl.utils.device:get_device_id",
        kind="replace",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint("def get_device_id() -> int", "e379ebb86ec94fa7"),
        replacement=f"{__name__}:get_device_id",
        flag="the CPU platform (no accelerator)",
        why="verl moves batches with .to(get_device_id()); the device module's index 0 would mean cuda:0, which "
            "does not exist on the host.",
        remove_when=_REMOVE,
        platforms=("cpu",),
    ),
    Patch(
        feature="cpu_platform",
        id="cpu.verl.device_module",
        target="verl.utils.device:get_torch_device",
        kind="replace",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint("def get_torch_device() -> any", "ff00b7e8438749a7"),
        replacement=f"{__name__}:get_torch_device",
        flag="the CPU platform (no accelerator)",
        why="verl's worker, sharding manager and checkpoint manager ask the device module for RNG state, memory "
            "statistics and empty_cache; torch.cpu has none of them in torch 2.5.1.",
        remove_when=_REMOVE,
        platforms=("cpu",),
    ),
]
