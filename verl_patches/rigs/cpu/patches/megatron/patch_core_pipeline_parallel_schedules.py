"""megatron-core's forward/backward schedules run with CUDA tensors made on the host (CPU platform only).

Upstream: megatron/core/pipeline_parallel/schedules.py:get_forward_backward_func returns the
schedule verl's actor calls for every forward and backward; the schedules create a few counters
with ``.cuda()`` (e.g. the token count of the pipelined schedule), which raises without a GPU.
The returned schedule runs under verl_patches/rigs/cpu/cuda_runtime.py:CudaOnCpu (tensors asked for on
CUDA are made on the host); the schedule itself is upstream's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def wrap_get_forward_backward_func(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_forward_backward_func():
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.rigs.cpu.cuda_runtime import on_host

        return on_host(original())

    return get_forward_backward_func


PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.megatron.schedules_on_host",
        target="megatron.core.pipeline_parallel.schedules:get_forward_backward_func",
        kind="wrap",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint("def get_forward_backward_func()", "1caf2422e67993ea"),
        replacement=f"{__name__}:wrap_get_forward_backward_func",
        flag="the CPU platform (no accelerator)",
        why="megatron-core's pipeline schedules make tensors with .cuda() whatever the device, which raises "
            "without a GPU; verl's Megatron actor runs every forward and backward through them.",
        remove_when="megatron-core's schedules allocate on the model's device.",
        platforms=("cpu",),
    ),
]
