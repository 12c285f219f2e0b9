"""What one rank's reshard did (shared by every method's executor), and the one step all of them
end with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from verl_patches.reshard.placements import Placements


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


def zero_padding(P: Placements, rank: int, roll: dict[str, torch.Tensor]) -> None:
    """vLLM zero-fills the vocab rows past the real vocabulary; do the same (no traffic)."""
    for slot in P.rollout_zero[rank]:
        slot.view(roll[slot.name]).zero_()
