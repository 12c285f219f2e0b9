"""Run a function on N local processes joined by torch.distributed (gloo on CPU, or the
device backend), and collect each rank's return value. Used by tests and by
``python -m verl_patches preflight``; benchmarks on GPUs use torchrun instead.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback
from multiprocessing.reduction import DupFd
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from verl_patches.base import env as overlay_env
from verl_patches.launch import procs, rank_boot
from verl_patches.base.ports import free_port_block
from verl_patches.base import accelerator


def free_port() -> int:
    """One free TCP port (outside the ephemeral range; see free_port_block)."""
    return free_port_block(1)


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable[..., Any],
            args: tuple, env: dict[str, str], queue: Any, parent_pid: int, ready: Any = None) -> None:
    # A rank outliving its caller would hold its memory (device memory too) for ever, and
    # would block writing its result into a pipe nobody reads. (A forked rank's parent is the
    # forkserver, which ends with the caller; the rank watches the caller too.)
    procs.die_with(parent_pid)
    # Only the parent reads: a rank holding the read end open too would keep a write into
    # a dead parent's full pipe blocked instead of failing.
    queue._reader.close()
    # The parent sends SIGUSR1 to a rank that hangs, so its Python stack reaches stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        rank_boot.check_preload()
        if backend != "gloo":
            accelerator.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        if ready is not None:
            ready[rank] = 1  # imported and joined: from now on the heartbeat limit applies (rank_boot.py)
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
    """One or more ranks raised or hung; the message holds each failing rank's traceback."""


def _dump_stacks(ranks: list[Any], which: list[int]) -> None:
    for r in which:
        if ranks[r].is_alive():
            try:
                os.kill(ranks[r].pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(2.0)  # let faulthandler write before the kill


def _context(backend: str) -> tuple[Any, Any]:
    """The multiprocessing context the ranks start from (``VERL_PATCHES_RANK_START``), and what a forked
    rank takes from the caller (``rank_boot.main``): its environment, stdout and stderr (None for a
    spawned rank, which inherits them).

    spawn: a fresh interpreter per rank (always, for a device backend). forkserver (gloo ranks): one
    server per calling process, started at its first
    call, imports ``VERL_PATCHES_RANK_PRELOAD`` once (verl_patches/launch/rank_preload.py) and forks every rank of
    every later call from that state; a rank then takes the caller's environment and standard streams of
    the call, since the server's are those of its own start.
    """
    # Device ranks always spawn: torch refuses CUDA in a child forked from a process that queried the device
    # (even torch.cuda.is_available() does, and megatron-core's import queries it on a GPU machine).
    if backend != "gloo" or overlay_env.get("VERL_PATCHES_RANK_START") == "spawn":
        return mp.get_context("spawn"), None
    ctx = mp.get_context("forkserver")
    # Read when the server starts (the first call); a later call's preload setting is the server's.
    ctx.set_forkserver_preload(["verl_patches.launch.rank_preload", "verl_patches.launch.rank_boot",
                                "verl_patches.launch.local_ranks"])

    stdio = {}
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            continue  # closed in the caller: the rank keeps the server's
        stdio[fd] = _Passed(fd, DupFd)
    return ctx, (dict(os.environ), stdio)


class _Passed:
    """A descriptor of the caller for a forked rank: multiprocessing's DupFd, made when the rank's
    arguments are pickled for the forkserver (it hands the descriptor over with them)."""

    def __init__(self, fd: int, dup: Any) -> None:
        self.fd, self.dup = fd, dup

    def __reduce__(self) -> Any:
        return (_identity, (self.dup(self.fd),))


def _identity(x: Any) -> Any:
    return x


def run_distributed(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
                    env: dict[str, str] | None = None, timeout: float = 300.0,
                    grace: float = 30.0, heartbeat: float | None = None,
                    startup: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` spawned processes; return results by rank.

    ``fn`` must be importable (module level) because ranks are spawned, or forked from a
    single-threaded forkserver (``VERL_PATCHES_RANK_START``, see ``_context``), never forked from the
    caller: forking a process that has imported torch with threads is unsafe. Once a rank fails, the
    others get ``grace`` seconds to finish (they usually wait in a collective for the failed
    one); ranks still running then, or at ``timeout``, have their Python stacks written to
    stderr and are killed. Raises DistributedFailure naming every rank that failed and every
    rank that hung after a failure, or TimeoutError naming the ranks that did not finish.

    Liveness: every rank beats (verl_patches/launch/rank_boot.py: a thread started before anything heavy is
    imported writes the clock into shared memory each second). A rank still running that has been
    stopped (process state T: SIGSTOP) for ``heartbeat`` seconds, or whose last beat is older than
    ``heartbeat`` seconds (default ``VERL_PATCHES_HEARTBEAT_TIMEOUT_S``, 120; ``startup`` seconds, if
    longer, until it has imported and joined its process group: loading torch holds the GIL), has
    stopped answering: it is named as failed, and the others get ``grace`` as after any failure. So
    a stopped or stuck rank ends the call within about ``heartbeat + grace`` seconds, not at ``timeout``.

    Stopping the caller stops the ranks: on KeyboardInterrupt and, in the main thread, SIGTERM
    or SIGHUP (raised as ``procs.Terminated``) every rank and whatever it started is killed
    before the exception propagates; a rank whose parent dies, even by SIGKILL, is killed by
    the kernel or by the rank's watch of the caller (``procs.die_with``).
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"run_distributed: world must be a positive integer, got {world!r}")
    if heartbeat is None:
        heartbeat = overlay_env.get("VERL_PATCHES_HEARTBEAT_TIMEOUT_S")
    if not (isinstance(heartbeat, (int, float)) and heartbeat > 0 and startup > 0):
        raise ValueError(f"run_distributed: heartbeat and startup must be positive seconds, got {heartbeat!r}, "
                         f"{startup!r} (0 would switch the liveness check off)")
    ctx, caller = _context(backend)
    queue = ctx.SimpleQueue()
    port = free_port()
    beats = ctx.Array("d", world, lock=False)  # 0.0: no beat yet
    ready = ctx.Array("b", world, lock=False)  # 1: imported and in the process group
    beat_every = min(1.0, heartbeat / 4)
    # rank_boot starts each rank's heartbeat first, then unpickles this (which imports torch and fn's module).
    # Plain pickle: ``fn`` and ``args`` travel by value (tensors as bytes), as the results come back.
    payloads = [pickle.dumps((_worker, (r, world, port, backend, fn, args, dict(env or {})), (os.getpid(),)))
                for r in range(world)]
    ranks = [ctx.Process(target=rank_boot.main, args=(beats, ready, r, beat_every, queue, payloads[r], caller),
                         daemon=False) for r in range(world)]
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    hung: list[int] = []
    finished = False
    with procs.stop_on_signals():
        try:
            for p in ranks:
                p.start()
            hung = _collect(ranks, queue, results, failures, timeout, grace, (beats, ready), heartbeat, startup)
            finished = True
        finally:
            if finished:
                for p in ranks:
                    p.join(timeout=0 if hung else 30)
            # Interrupted, hung, or slow to exit after reporting: the whole tree goes.
            procs.kill_tree([p.pid for p in ranks if p.pid is not None and p.is_alive()], grace=0 if hung else 3)
            for p in ranks:
                if p.pid is not None:
                    p.join()
    if failures:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        if hung:
            msg += (f"\n--- ranks {hung} were still running {grace:.0f}s after the first failure (most likely "
                    f"waiting in a collective for a failed rank); their stacks are on stderr ---")
        raise DistributedFailure(f"{len(failures)} of {len(ranks)} rank(s) failed:\n{msg}")
    if hung:
        raise TimeoutError(f"run_distributed: rank(s) {hung} of {len(ranks)} did not finish in {timeout:.0f}s; "
                           f"their stacks are on stderr")
    return [results[r] for r in range(len(ranks))]


def _stopped_since(pid: int, seen: dict[int, float], now: float) -> float | None:
    """Since when ``pid`` has been in the stopped state (SIGSTOP: T, or t under a tracer), by this
    caller's observations; None while it is not stopped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        state = ""
    if state in ("T", "t"):
        return seen.setdefault(pid, now)
    seen.pop(pid, None)
    return None


def _silent_ranks(ranks: list[Any], done: set[int], liveness: tuple[Any, Any], heartbeat: float, startup: float,
                  start: float, now: float, stopped_seen: dict[int, float]) -> dict[int, str]:
    """The running ranks that stopped answering, each with why: stopped (process state T) for
    ``heartbeat`` seconds, or no heartbeat for ``heartbeat`` seconds (``startup``, if longer, until the
    rank is ready: importing torch holds the GIL, and so the heartbeat thread, for seconds)."""
    beats, ready = liveness
    out = {}
    for r, p in enumerate(ranks):
        if r in done or not p.is_alive():
            continue
        since = _stopped_since(p.pid, stopped_seen, now)
        last = beats[r]
        silent = now - (last if last else start)
        limit = heartbeat if ready[r] else max(startup, heartbeat)
        if not (silent > limit or (since is not None and now - since > heartbeat)):
            continue
        if since is not None:
            why = (f"it is stopped (process state T: SIGSTOP), seen so for {now - since:.0f} s, no heartbeat for "
                   f"{silent:.0f} s (limit {heartbeat:g} s)")
        else:
            why = (f"no heartbeat for {silent:.0f} s (limit {limit:g} s{'' if ready[r] else ', starting up'}): "
                   "swapped out, or stuck in native code holding the GIL")
        out[r] = f"rank {r} (pid {p.pid}) stopped answering: {why}"
    return out


def _collect(ranks: list[Any], queue: Any, results: dict[int, Any], failures: dict[int, str],
             timeout: float, grace: float, liveness: tuple[Any, Any] | None = None, heartbeat: float = float("inf"),
             startup: float = float("inf")) -> list[int]:
    """Read every rank's report into ``results`` / ``failures``; return the ranks that hung."""
    world = len(ranks)
    start = time.monotonic()
    failed_at: float | None = None
    stopped_seen: dict[int, float] = {}
    next_look = start
    while len(results) + len(failures) < world:
        now = time.monotonic()
        if liveness is not None and now >= next_look:
            next_look = now + min(0.25, heartbeat / 8)
            silent = _silent_ranks(ranks, set(results) | set(failures), liveness, heartbeat, startup, start, now,
                                   stopped_seen)
            for r, why in sorted(silent.items()):
                failures[r] = why + "\n"
                print(f"run_distributed: {why}; stopping the run", file=sys.stderr, flush=True)
                failed_at = failed_at if failed_at is not None else now
        if now > start + timeout or (failed_at is not None and now > failed_at + grace):
            hung = [r for r in range(world) if r not in results and r not in failures]
            _dump_stacks(ranks, hung)
            return hung
        if queue.empty():
            # A rank that died without reporting (killed, segfault) cannot answer; its
            # result would already be in the queue had it put one before exiting.
            for i, p in enumerate(ranks):
                if p.exitcode not in (None, 0) and i not in results and i not in failures and queue.empty():
                    failures[i] = f"process exited with code {p.exitcode} without a result"
                    failed_at = failed_at if failed_at is not None else time.monotonic()
            time.sleep(0.02)
            continue
        rank, ok, payload = queue.get()
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
            failed_at = failed_at if failed_at is not None else time.monotonic()
    return []
