"""Run a function on N local processes joined by torch.distributed (gloo on CPU, or the
device backend), and collect each rank's return value. Used by tests and by
``python -m verl_patches preflight``; benchmarks on GPUs use torchrun instead.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable[..., Any],
            args: tuple, env: dict[str, str], queue: Any) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        if backend != "gloo":
            from verl_patches import accelerator

            accelerator.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        # Plain pickle (a byte copy): torch's queue pickling would pass tensors as shared
        # memory handles, which die with this process before the parent reads them.
        payload = pickle.dumps(fn(rank, world, *args))
        queue.put((rank, True, payload))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the rank named
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class DistributedFailure(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def run_distributed(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
                    env: dict[str, str] | None = None, timeout: float = 300.0) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` spawned processes; return results by rank.

    ``fn`` must be importable (module level) because processes are spawned, not forked:
    forking a process that has imported torch with threads is unsafe. Raises
    DistributedFailure naming every rank that failed, or TimeoutError.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, dict(env or {}), queue),
                    daemon=False)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run_distributed: {world - len(results) - len(failures)} rank(s) "
                                   f"did not finish in {timeout:.0f}s")
            if queue.empty():
                if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    # A rank that died without reporting (killed, segfault) cannot answer.
                    for i in dead:
                        if i not in results and i not in failures:
                            failures[i] = f"process exited with code {procs[i].exitcode} without a result"
                    if len(results) + len(failures) >= world:
                        break
                time.sleep(0.02)
                continue
            rank, ok, payload = queue.get()
            (results if ok else failures)[rank] = pickle.loads(payload) if ok else payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise DistributedFailure(f"{len(failures)} of {world} rank(s) failed:\n{msg}")
    return [results[r] for r in range(world)]
