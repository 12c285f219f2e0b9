"""torch.cuda's generator calls answered by the host generator (CPU platform only).

Upstream: torch/cuda/random.py (torch 2.5.1). megatron-core's RNG tracker
(megatron/core/tensor_parallel/random.py) seeds, saves and restores "the CUDA generator" to give
tensor-parallel and expert-parallel ranks their own random streams (initialisation, dropout).
On the host every op draws from torch's default CPU generator, so that generator plays the
device's: the tracker's forks keep their meaning. Never applied on NPU or CUDA.
"""

from __future__ import annotations

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch



def get_rng_state(device="cuda"):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch

    return torch.get_rng_state()


def set_rng_state(new_state, device="cuda"):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch

    torch.set_rng_state(new_state)


def manual_seed(seed):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch

    torch.manual_seed(seed)



def _record(name: str, signature: str, sha: str) -> Patch:
    return Patch(feature="cpu_platform", id=f"cpu.torch.cuda_{name}", target=f"torch.cuda.random:{name}", kind="replace",
                 phases=("worker",), upstream="torch", versions="==2.5.1", fingerprint=Fingerprint(signature, sha),
                 replacement=f"{__name__}:{name}", flag="the CPU platform (no accelerator)",
                 why="megatron-core's RNG tracker reads and sets the CUDA generator whatever the device, which "
                     "raises without a GPU; on the host the default generator is the one every op uses.",
                 remove_when="megatron-core's RNG tracker takes its generator from an accelerator abstraction.",
                 platforms=("cpu",))


PATCHES = [
    _record("get_rng_state", "def get_rng_state(device: Union[int, str, torch.device]='cuda') -> Tensor",
            "c37f83bc740d221d"),
    _record("set_rng_state", "def set_rng_state(new_state: Tensor, device: Union[int, str, torch.device]='cuda') "
                             "-> None", "7c5de68d245df723"),
    _record("manual_seed", "def manual_seed(seed: int) -> None", "3e116f2cb71af672"),
]
