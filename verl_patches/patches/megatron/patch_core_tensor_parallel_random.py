"""megatron-core's RNG tracker sets the host generator on the CPU platform (a fork really switches streams).

Upstream: megatron/core/tensor_parallel/random.py:_set_cuda_rng_state. Its callback sets the CUDA
generator through ``torch.cuda._lazy_call``; without a CUDA driver torch queues that callback
forever, so every ``get_cuda_rng_tracker().fork()`` would silently keep the old random stream.
On the host the tracker's state is the default generator's (patch cpu.torch.cuda_get_rng_state
reads it), so setting it is ``torch.set_rng_state``. Never applied on NPU or CUDA.
"""

from __future__ import annotations

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch



def set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    import torch

    torch.set_rng_state(new_state)


PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.megatron.rng_tracker_set_state",
        target="megatron.core.tensor_parallel.random:_set_cuda_rng_state",
        kind="replace",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint("def _set_cuda_rng_state(new_state: torch.Tensor, device: int=-1, graph_safe: bool=False)",
                                "519f7aaa452f0702"),
        replacement=f"{__name__}:set_cuda_rng_state",
        flag="the CPU platform (no accelerator)",
        why="Without a CUDA driver the upstream defers the generator change forever and returns, so the RNG "
            "tracker's forks (per-rank initialisation and dropout streams) would silently not fork.",
        remove_when="megatron-core's RNG tracker takes its generator from an accelerator abstraction.",
        platforms=("cpu",),
    ),
]
