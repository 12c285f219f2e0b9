"""verl's timing reduction over gloo (CPU platform only).

Upstream: verl/utils/debug/performance.py:reduce_timing averages each worker's timings with
``all_reduce(ReduceOp.AVG)``, which gloo does not implement; verl's Megatron worker calls it after
every generation. On the CPU platform the same average is taken from every rank's values, gathered
(float64). Not a SUM all-reduce: on the NPU rehearsal platform (which applies this record,
verl_patches/rigs/npu_rehearsal/records.py) MindSpeed's adaptor wraps ``torch.distributed.all_reduce`` so that a
float64 tensor is reduced as a float32 copy whose result never reaches the caller's tensor
(mindspeed/core/megatron_basic/requirements_basic.py: torch_all_reduce_double_dtype_bypass_wrapper): every
rank kept its own values, and the report showed a quarter of each switch figure on 4 ranks.
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
    everyone = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, values)
    return dict(zip(keys, torch.stack(everyone).mean(dim=0).tolist()))


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
