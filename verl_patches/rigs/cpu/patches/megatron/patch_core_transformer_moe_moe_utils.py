"""The MoE dispatcher's split sizes on the host (CPU platform only).

Upstream: megatron/core/transformer/moe/moe_utils.py:maybe_move_tensor_to_cpu. The alltoall
dispatcher moves its token counts "to the CPU" as numpy arrays for the all-to-all's split sizes,
but only for tensors that are on a GPU; host tensors come back as tensors, which
torch.distributed.all_to_all_single refuses as split sizes. On the host the counts are already
here: ours returns them as numpy arrays where asked, the form the dispatcher expects.
"""

from __future__ import annotations

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch

    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.megatron.moe_host_split_sizes",
        target="megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
        kind="replace",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint("def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False)",
                                "488819956db934fd"),
        replacement=f"{__name__}:maybe_move_tensor_to_cpu",
        flag="the CPU platform (no accelerator)",
        why="The alltoall token dispatcher (the recipe's) needs its split sizes as host arrays; upstream converts "
            "only GPU tensors, so on the host the all-to-all gets tensors and raises.",
        remove_when="megatron-core converts host tensors too (a one-line condition).",
        platforms=("cpu",),
    ),
]
