"""The first code a rank of ``run_distributed`` (verl_patches/launch/local_ranks.py) runs: it starts the rank's
heartbeat before anything heavy is imported, then unpickles and calls the real entry point.

Standard library only, so a spawned rank beats within the interpreter's start-up: importing torch
and the rank's function (seconds, or tens of seconds on a loaded host) happens after the first beat.
The heartbeat is a thread, so it beats while the rank computes or waits in a collective (both release
the GIL) and stops when the process is stopped (SIGSTOP), swapped out or stuck holding the GIL; the
parent names a rank whose last beat is too old.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from typing import Any


def _beat(beats: Any, rank: int, every: float) -> None:
    while True:
        beats[rank] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
        time.sleep(every)


def _take_environment(environ: dict[str, str]) -> None:
    """A forked rank (forkserver) holds the server's environment, not its caller's: take the caller's,
    plus what the server's preloaded imports set and the caller does not (verl_patches/launch/rank_preload.py)."""
    preload = sys.modules.get("verl_patches.launch.rank_preload")
    added = dict(getattr(preload, "ENV_SET_BY_IMPORTS", {}))
    os.environ.clear()
    os.environ.update(environ)
    for k, v in added.items():
        os.environ.setdefault(k, v)


def check_preload() -> None:
    """Raise, naming them, if the forkserver this rank was forked from failed to import its preload."""
    failed = getattr(sys.modules.get("verl_patches.launch.rank_preload"), "FAILED", ())
    if failed:
        raise ImportError("the forkserver of run_distributed could not preload "
                          f"{'; '.join(failed)} (VERL_PATCHES_RANK_PRELOAD names a module this environment "
                          "cannot import)")


def _take_stdio(stdio: dict[int, Any]) -> None:
    """A forked rank's stdout and stderr are the server's (those of the caller when the server started):
    point them at the caller's of this call (``stdio``: fd -> multiprocessing's passed descriptor)."""
    for target, passed in stdio.items():
        fd = passed.detach()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None and not stream.closed:
                stream.flush()
        os.dup2(fd, target)
        os.close(fd)


def main(beats: Any, ready: Any, rank: int, every: float, queue: Any, payload: bytes,
         caller: tuple[dict[str, str], dict[int, Any]] | None = None) -> None:
    """``caller``: the caller's environment and stdout / stderr, for a rank forked from the forkserver
    (None: spawned, it has the caller's already)."""
    threading.Thread(target=_beat, args=(beats, rank, every), daemon=True, name="heartbeat").start()
    if caller is not None:
        _take_stdio(caller[1])
        _take_environment(caller[0])
    target, head, tail = pickle.loads(payload)  # imports the entry point's modules (torch)
    target(*head, queue, *tail, ready=ready)
