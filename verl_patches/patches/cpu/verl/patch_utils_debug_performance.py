"""verl's timing reduction over gloo (CPU platform only).

Upstream: verl/utils/debug/performance.py:reduce_timing averages each worker's timings with
``all_reduce(ReduceOp.AVG)``, which gloo does not implement; verl's Megatron worker calls it after
every generation. On the CPU platform the same average is a SUM divided by the world size.
"""

from __future__ import annotations

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def reduce_timing(timing_raw):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or not timing_raw:
        return timing_raw
    keys = sorted(timing_raw)
    values = torch.tensor([float(timing_raw[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return dict(zip(keys, (values / dist.get_world_size()).tolist()))


PATCHES = [
    Patch(
        feature="cpu_platform",
        id="cpu.verl.reduce_timing",
        target="verl.utils.debug.performance:reduce_timing",
        kind="replace",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint("def reduce_timing(timing_raw: Dict[str, float]) -> Dict[str, float]",
                                "63524b6d129ed755"),
        replacement=f"{__name__}:reduce_timing",
        flag="the CPU platform (gloo)",
        why="gloo has no AVG reduction, so every generation step of verl's Megatron worker fails on the host.",
        remove_when="verl averages its timings with SUM / world size, or gloo implements AVG.",
        platforms=("cpu",),
    ),
]
