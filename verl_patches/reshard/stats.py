"""What one rank's weight update did (every method's, ours and the two references'): bytes over the links,
collectives, the largest transient buffer set, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ExecStats:
    """What one rank did: bytes it received / sent over the links, collectives issued, and the
    largest transient buffer set it held (bytes, counted from the buffers it allocated)."""

    method: str
    recv_bytes: int = 0
    sent_bytes: int = 0
    local_bytes: int = 0
    collectives: int = 0
    peak_extra_bytes: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
