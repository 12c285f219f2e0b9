"""The alltoall dispatcher built with a host stream (CPU platform only).

Upstream: megatron/core/transformer/moe/token_dispatcher.py:MoEAlltoAllTokenDispatcher.__init__
creates ``torch.cuda.Stream()`` for its device-to-host copies of the split sizes, which raises
without a GPU. We run the constructor with ``torch.cuda.Stream`` answering a host stream (program
order; verl_patches/rigs/cpu/cuda_runtime.py) and restore it afterwards; the dispatcher itself runs as
written, with the recipe's alltoall dispatch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.rigs.cpu.cuda_runtime import host_stream_class

        with host_stream_class():
            original(self, *args, **kwargs)

    return __init__


PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.megatron.alltoall_dispatcher_host_stream",
        target="megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher.__init__",
        kind="wrap",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint("def __init__(self, num_local_experts: int, local_expert_indices: List[int], "
                                "config: TransformerConfig) -> None", "902258f52e3e5981"),
        replacement=f"{__name__}:wrap_init",
        flag="the CPU platform (no accelerator)",
        why="The recipe's alltoall token dispatcher makes a CUDA side stream in its constructor, which raises "
            "without a GPU; on the host the program order is the stream.",
        remove_when="megatron-core creates the dispatcher's side stream through an accelerator abstraction.",
        platforms=("cpu",),
    ),
]
