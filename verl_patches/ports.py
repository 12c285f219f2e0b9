"""TCP ports for rendezvous: which are free on this host, and which the kernel may hand out by itself.

A port inside the kernel's ephemeral range can be taken at any moment by an outgoing
connection (every gloo / HCCL pair connection, every store client), so a rendezvous port
belongs below it.
"""

from __future__ import annotations

import socket

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
