"""TCP ports for rendezvous: which are free on this host, and which the kernel may hand out by itself.

A port inside the kernel's ephemeral range can be taken at any moment by an outgoing
connection (every gloo / HCCL pair connection, every store client), so a rendezvous port
belongs below it.
"""

from __future__ import annotations

import os
import random
import socket
import time

# Linux's default, used when the setting cannot be read.
EPHEMERAL_DEFAULT = (32768, 60999)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (connect(), bind to port 0), inclusive."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def bindable(port: int) -> bool:
    """Whether a listening socket could take ``port`` on every interface now (as a TCPStore does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def taken_ports(base: int, count: int) -> list[int]:
    return [p for p in range(base, base + count) if not bindable(p)]


def overlaps_ephemeral(base: int, count: int) -> bool:
    lo, hi = ephemeral_range()
    return base <= hi and base + count - 1 >= lo


_LOWEST_PORT = 10000


def free_port_block(count: int = 1, tries: int = 200, low: int | None = None) -> int:
    """First of ``count`` consecutive TCP ports that are free now, at or above ``low`` (default
    10000) and below the kernel's ephemeral range.

    Ports the kernel hands out on its own (every gloo pair connection, every client socket)
    come from the ephemeral range, so a port taken from there and bound later by a rendezvous
    can meanwhile be in use by one of the job's own connections; below that range only an
    explicit bind takes a port. The start is random so runs side by side rarely pick the same
    block, and every port of the block is checked.
    """
    if count < 1:
        raise ValueError(f"free_port_block: count must be >= 1, got {count}")
    lowest = _LOWEST_PORT if low is None else low
    low = ephemeral_range()[0]
    top = low - count
    if top < lowest:
        raise RuntimeError(f"free_port_block: no room for {count} ports between {lowest} and the "
                           f"ephemeral range starting at {low}")
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(tries):
        base = rng.randint(lowest, top)
        if all(bindable(base + k) for k in range(count)):
            return base
    raise RuntimeError(f"free_port_block: no {count} consecutive free ports found in {tries} tries "
                       f"between {lowest} and {low}")
