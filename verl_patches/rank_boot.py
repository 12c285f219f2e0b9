"""The first code a rank of ``run_distributed`` (verl_patches/launch.py) runs: it starts the rank's
heartbeat before anything heavy is imported, then unpickles and calls the real entry point.

Standard library only, so a spawned rank beats within the interpreter's start-up: importing torch
and the rank's function (seconds, or tens of seconds on a loaded host) happens after the first beat.
The heartbeat is a thread, so it beats while the rank computes or waits in a collective (both release
the GIL) and stops when the process is stopped (SIGSTOP), swapped out or stuck holding the GIL; the
parent names a rank whose last beat is too old.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any


def _beat(beats: Any, rank: int, every: float) -> None:
    while True:
        beats[rank] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
        time.sleep(every)


def main(beats: Any, ready: Any, rank: int, every: float, queue: Any, payload: bytes) -> None:
    threading.Thread(target=_beat, args=(beats, rank, every), daemon=True, name="heartbeat").start()
    target, head, tail = pickle.loads(payload)  # imports the entry point's modules (torch)
    target(*head, queue, *tail, ready=ready)
