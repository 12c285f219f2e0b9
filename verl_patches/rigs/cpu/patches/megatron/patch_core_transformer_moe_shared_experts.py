"""Shared experts with stream overlap built with a host stream (CPU platform only).

Upstream: megatron/core/transformer/moe/shared_experts.py:SharedExpertMLP.__init__ creates
``torch.cuda.Stream()`` when moe_shared_expert_overlap is on (verl's DeepSeek-V3 config turns it
on), which raises without a GPU. As for the dispatcher, the constructor runs with
``torch.cuda.Stream`` answering a host stream; the overlap code then runs in program order.
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
        id="cpu.megatron.shared_experts_host_stream",
        target="megatron.core.transformer.moe.shared_experts:SharedExpertMLP.__init__",
        kind="wrap",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint("def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, gate: bool)",
                                "4c2d1fbfaacb5a63"),
        replacement=f"{__name__}:wrap_init",
        flag="the CPU platform (no accelerator)",
        why="verl's DeepSeek-V3 config overlaps the shared experts with the dispatcher on a CUDA stream made in the "
            "constructor, which raises without a GPU.",
        remove_when="megatron-core creates the shared experts' stream through an accelerator abstraction.",
        platforms=("cpu",),
    ),
]
