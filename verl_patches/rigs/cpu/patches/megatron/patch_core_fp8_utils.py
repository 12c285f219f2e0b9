"""The distributed optimizer's fp8 parameter step without Transformer Engine (CPU platform only).

Upstream: megatron/core/fp8_utils.py:quantize_param_shard. DistributedOptimizer calls it on every
step to cast fp32 main shards into fp8 model parameters; megatron-core 0.12.1 defines it, when
Transformer Engine is absent, as a function that always raises, even for an empty list of fp8
parameters. On CUDA Transformer Engine is present; on NPU MindSpeed registers its own
(mindspeed/core/fp8_utils.py). On the host there is neither and there are no fp8 parameters:
ours returns, and raises if one ever appears.
"""

from __future__ import annotations

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def quantize_param_shard(model_params, main_params, start_offsets, data_parallel_group, fsdp_shard_model_params=None):
    if len(model_params):
        raise RuntimeError(f"{len(model_params)} fp8 model parameters on the CPU platform: fp8 training needs "
                           "Transformer Engine (CUDA) or MindSpeed (NPU)")


PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.megatron.fp8_quantize_without_te",
        target="megatron.core.fp8_utils:quantize_param_shard",
        kind="replace",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint("def quantize_param_shard(model_params, main_params, start_offsets, data_parallel_group, "
                                "fsdp_shard_model_params=None)", "5d9015081eba06e7"),
        replacement=f"{__name__}:quantize_param_shard",
        flag="the CPU platform (no accelerator)",
        why="Without Transformer Engine megatron-core 0.12.1's fp8 cast raises on every optimizer step, even with "
            "no fp8 parameter, so the distributed optimizer cannot step on the host.",
        remove_when="megatron-core skips the fp8 cast when there are no fp8 parameters (it does in later releases).",
        platforms=("cpu",),
    ),
]
