"""megatron-core's RNG tracker sets the host generator on the CPU platform (a fork really switches streams).

Upstream: megatron/core/tensor_parallel/random.py:_set_cuda_rng_state. Its callback sets the CUDA
generator through ``torch.cuda._lazy_call``; without a CUDA driver torch queues that callback
forever, so every ``get_cuda_rng_tracker().fork()`` would silently keep the old random stream.
On the host the tracker's state is the default generator's (patch cpu.torch.cuda_get_rng_state
reads it), so setting it is ``torch.set_rng_state``. Never applied on NPU or CUDA.

And ``CudaRNGStatesTracker.fork``: upstream saves the "CUDA" state, sets the tracker's, records the
CPU generator's state, runs the body and warns ``CPU RNG state changed within GPU RNG context`` when
the CPU state moved. On the host the two generators are one (the patches above), so every fork whose
body draws a random number (each weight initialisation, each dropout) moved it: 328 of the tiny
run's 1653 console lines were that warning, each one a correct fork. Ours swaps the host generator's
state in and out the same way, without a second generator to compare.
"""

from __future__ import annotations

import contextlib

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch



def set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch

    torch.set_rng_state(new_state)


@contextlib.contextmanager
def fork(self, name=None):
    """The tracker's stream ``name`` (megatron-core's model-parallel one by default) for the body, on the
    host generator; the stream's advance is kept for the next fork and the previous state comes back."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

    name = _MODEL_PARALLEL_RNG_TRACKER_NAME if name is None else name
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    if self.use_cudagraphable_rng:
        raise RuntimeError("the RNG tracker's CUDA-graph-safe states need CUDA; the CPU platform has no graphs "
                           "(turn off use_cudagraphable_rng)")
    outside = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outside)


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
    Patch(
        feature="cpu_platform",
        id="cpu.megatron.rng_tracker_fork",
        target="megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork",
        kind="replace",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint("def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME)", "62b75a5928fc449f"),
        replacement=f"{__name__}:fork",
        requires=("cpu.megatron.rng_tracker_set_state",),
        flag="the CPU platform (no accelerator)",
        why="On the host the device generator is the CPU generator, so upstream's check that a fork left the CPU "
            "generator alone fails on every fork that draws a number: hundreds of 'CPU RNG state changed within GPU "
            "RNG context' warnings per run, each about a correct fork, burying the run's output.",
        remove_when="megatron-core's RNG tracker takes its generator from an accelerator abstraction.",
        platforms=("cpu",),
    ),
]
