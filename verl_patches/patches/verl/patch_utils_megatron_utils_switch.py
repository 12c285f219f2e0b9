"""megatron-core's own CPU optimizer offload (HybridDeviceOptimizer) reaches the optimizer verl builds.

Upstream: verl/utils/megatron_utils.py:init_megatron_optim_config(optim_config) builds megatron-core
0.12.1's OptimizerConfig from actor.optim with lr, min_lr, clip_grad and weight_decay only. OptimizerConfig
has ``optimizer_cpu_offload`` and ``optimizer_offload_fraction`` (megatron/core/optimizer/optimizer_config.py),
and with them get_megatron_optimizer builds a HybridDeviceOptimizer (optimizer/cpu_offloading/
hybrid_optimizer.py) under the DistributedOptimizer: the fp32 master shards, Adam's moments and a pinned
fp32 copy of the gradients live on the host, the Adam step runs there, and the updated parameters come back
to the device. verl 0.4.1 passes none of this on. We wrap it: with ``actor.optim.optimizer_cpu_offload:
True`` the config upstream returns gets

- ``optimizer_cpu_offload=True`` and ``optimizer_offload_fraction`` (``actor.optim.optimizer_offload_fraction``,
  default 1.0: all of the optimizer on the host);
- ``use_precision_aware_optimizer=True``: without it the DistributedOptimizer still makes an fp32 master
  shard on the device for every bf16 shard and hands those to the hybrid optimizer, so 4 of Adam's 12
  bytes per parameter stay on the device; with it the shards it hands over are views of the bf16 params and
  the hybrid optimizer makes the fp32 masters on the host. Megatron-LM's training arguments require the
  pair for the same reason (``--optimizer-cpu-offload`` asserts ``--use-precision-aware-optimizer``);
  megatron-core's OptimizerConfig does not check it;
- ``overlap_cpu_optimizer_d2h_h2d`` from ``actor.optim`` when given (megatron-core's default, False, else).

Where it cannot combine, it is refused by name (OptimizerOffloadError): a fraction outside (0, 1], an
optimizer other than adam or sgd, a non-distributed optimizer, and, in the worker
(patch_workers_megatron_workers_switch.py), MindSpeed's swap optimizer, which would move the same state a
second time. The recipe's switch loop moves only the optimizer tensors that are on the device
(verl_patches/offload/megatron_memory.py): with the fraction 1.0 there are none, and the host copies are
never touched (docs/DESIGN.md section 3).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
# The settings' rules live below the patch (verl_patches/config/optim_offload.py): the launch-time validator reads them too.
from verl_patches.config.optim_offload import FLAG, KEYS, OptimizerOffloadError, apply_offload, offload_settings  # noqa: F401


def wrap_init_megatron_optim_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_megatron_optim_config(optim_config, *args, **kwargs):
        settings = offload_settings(optim_config)
        config = original(optim_config, *args, **kwargs)
        return config if settings is None else apply_offload(config, settings)

    return init_megatron_optim_config


PATCHES = [
    Patch(
        feature="switch",
        id="verl.optim.cpu_offload",
        target="verl.utils.megatron_utils:init_megatron_optim_config",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(signature="def init_megatron_optim_config(optim_config: Dict) -> OptimizerConfig",
                                source_sha="273362ab847c28d5"),
        replacement=f"{__name__}:wrap_init_megatron_optim_config",
        flag=FLAG + " / optimizer_offload_fraction / overlap_cpu_optimizer_d2h_h2d (absent: the optimizer on the "
                    "device)",
        why="On 16 x 8 H100 the distributed optimizer's state (64 GiB per GPU, docs/NVIDIA.md) does not fit next "
            "to the parameters and gradients; megatron-core 0.12.1 can keep it on the host (HybridDeviceOptimizer), "
            "but verl 0.4.1 builds its OptimizerConfig without those fields, so the YAML's setting would be "
            "silently ignored and the run would run out of memory.",
        remove_when="verl's init_megatron_optim_config passes megatron-core's optimizer offload fields on (later "
                    "verl releases build OptimizerConfig from every key of actor.optim).",
        after=("verl.optim.adam_betas",),
    ),
]
