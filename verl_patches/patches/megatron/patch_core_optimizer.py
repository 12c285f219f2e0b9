"""megatron-core's (distributed) optimizer built and stepped with CUDA tensors made on the host (CPU platform only).

Upstream: megatron/core/optimizer/__init__.py:get_megatron_optimizer, which verl's Megatron
worker calls (verl_patches aliases it through verl.utils.megatron.optimizer). The optimizers it
builds make scalars with ``device='cuda'`` (found-inf, loss scale, grad-norm buffers) and accept
only parameters whose ``.type()`` is a CUDA type. On the host the optimizer is built, stepped,
saved and loaded under verl_patches/cpu/cuda_runtime.py:CudaOnCpu: those scalars are made on the
host and host parameters report their CUDA type. The optimizers themselves are upstream's (the
DistributedOptimizer the recipe uses, its fp32 main shards and Adam state).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

# What verl's worker and checkpoint manager call on the optimizer it got back.
HOST_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict", "sharded_state_dict", "reload_model_params",
                "get_loss_scale")


def wrap_get_megatron_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_megatron_optimizer(*args, **kwargs):
        from verl_patches.cpu.cuda_runtime import on_host

        optimizer = on_host(original)(*args, **kwargs)
        for name in HOST_METHODS:
            method = getattr(optimizer, name, None)
            if callable(method):
                setattr(optimizer, name, on_host(method))
        return optimizer

    return get_megatron_optimizer


PATCHES = [
    Patch(
        id="cpu.megatron.optimizer_on_host",
        target="megatron.core.optimizer:get_megatron_optimizer",
        kind="wrap",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint(
            "def get_megatron_optimizer(config: OptimizerConfig, model_chunks: List[MegatronModule], "
            "no_weight_decay_cond: Optional[Callable]=None, scale_lr_cond: Optional[Callable]=None, "
            "lr_mult: float=1.0, use_gloo_process_groups: bool=True) -> MegatronOptimizer", "cf634afbf27313d4"),
        replacement=f"{__name__}:wrap_get_megatron_optimizer",
        flag="the CPU platform (no accelerator)",
        why="megatron-core's optimizers allocate scalars on 'cuda' and accept only CUDA parameter types, so the "
            "recipe's distributed optimizer cannot be built or stepped on the host otherwise.",
        remove_when="megatron-core's optimizers allocate on the parameters' device and check dtypes, not CUDA "
                    "type names.",
        extra={"platforms": ("cpu",)},
    ),
]
