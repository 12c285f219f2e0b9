"""Per-rank bodies for test_launch.py (next to it): spawned processes import them by name."""

from __future__ import annotations

import time

import torch.distributed as dist


def one_rank_raises(rank: int, world: int, others_wait: str) -> int:
    """Rank 1 raises; the others meet in a barrier (gloo then fails them too, once rank 1's
    connections close) or wait without end (as a rank in an NCCL collective does)."""
    if rank == 1:
        raise ValueError("rank 1 refuses")
    if others_wait == "barrier":
        dist.barrier()
    else:
        time.sleep(3600)
    return rank


def one_rank_sleeps(rank: int, world: int, seconds: float) -> int:
    if rank == world - 1:
        time.sleep(seconds)
    return rank


def echo(rank: int, world: int, value: object) -> tuple[int, int, object]:
    return rank, dist.get_world_size(), value


def report_pid_and_wait(rank: int, world: int, directory: str) -> int:
    """Announce this rank's pid (the test's readiness signal), then wait as a rank stuck in a
    collective would, until something kills it."""
    import os
    from pathlib import Path

    path = Path(directory) / f"rank{rank}.pid"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").replace(path)
    time.sleep(3600)
    return rank


def spin(rank: int, world: int, ready: str, seconds: float, hold_gil_rank: int = -1) -> int:
    """Collectives for ``seconds``; says it is running by writing its pid into ``ready``. Rank
    ``hold_gil_rank`` instead calls libc's sleep holding the GIL (ctypes.PyDLL keeps it), as native code
    stuck without releasing it would: its heartbeat thread cannot run."""
    import os
    from pathlib import Path

    import torch

    t = torch.zeros(1)
    dist.all_reduce(t)
    Path(ready, f"rank{rank}").write_text(str(os.getpid()))
    if rank == hold_gil_rank:
        import ctypes

        ctypes.PyDLL(None).sleep(int(seconds))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        dist.all_reduce(t)
        time.sleep(0.02)
    return rank


def environment_and_modules(rank: int, world: int, names: list[str]) -> tuple[dict, bool, int]:
    """What a rank sees: the named variables, whether megatron-core was already imported when the body
    began (forked from a server that preloaded it), and its parent's pid."""
    import os
    import sys

    return {n: os.environ.get(n) for n in names}, "megatron.core" in sys.modules, os.getppid()
