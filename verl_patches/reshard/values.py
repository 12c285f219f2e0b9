"""Seeded model values computable for any slice alone: the ground truth of the preflight.

Element i of logical tensor T at step s is a hash of (seed, s, T's name, i). So a rank can
produce its training shard, and check its rollout shard, without anyone materialising the
full tensor, which is what makes a 671B preflight on the cluster possible.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Sequence

import torch

from verl_patches.reshard.placements import Placements

Box = Sequence[tuple[int, int]]
_M32 = 0xFFFFFFFF
_CHUNK = 1 << 22  # elements hashed at once: bounds the int64 temporaries (32 MiB)


def _mix(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (lowbias32 family); products stay below 2**59 in int64.
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def _key(seed: int, step: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{step}/{name}".encode()) & _M32


def _flat_indices(shape: Sequence[int], box: Box, device: torch.device) -> torch.Tensor:
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    flat = torch.zeros((), dtype=torch.int64, device=device)
    for d, (a, b) in enumerate(box):
        view = [1] * len(box)
        view[d] = b - a
        flat = flat + (torch.arange(a, b, dtype=torch.int64, device=device) * strides[d]).view(view)
    return flat


def box_values(name: str, shape: Sequence[int], box: Box, *, seed: int, step: int,
               dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The values of ``box`` of logical tensor ``name`` (full ``shape``), shaped like the box."""
    device = torch.device(device)
    out = torch.empty([b - a for a, b in box], dtype=dtype, device=device)
    if out.numel() == 0:
        return out
    key = _key(seed, step, name)
    # Hash chunk by chunk along dim 0 so a large shard never needs numel x 8 bytes at once.
    rows = box[0][1] - box[0][0]
    per_row = max(1, out.numel() // max(rows, 1))
    step_rows = max(1, _CHUNK // per_row)
    for r0 in range(0, rows, step_rows):
        r1 = min(rows, r0 + step_rows)
        sub = ((box[0][0] + r0, box[0][0] + r1), *box[1:])
        flat = _flat_indices(shape, sub, device)
        h = _mix((flat & _M32) ^ _mix((flat >> 32) ^ key))
        # 24 random bits -> uniform in [-1, 1), scaled like initialised weights.
        u = (h & 0xFFFFFF).to(torch.float32) * (2.0 / (1 << 24)) - 1.0
        out[r0:r1] = (u * 0.05).to(dtype)
    return out


def _fill(storage_shapes: dict[str, tuple[int, ...]], parts_of, rank: int, placements: Placements, *,
          seed: int, step: int, dtype: torch.dtype, device: Any) -> dict[str, torch.Tensor]:
    out = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in storage_shapes.items()}
    for t in placements.tensors:
        for part in parts_of(t):
            if rank in part.ranks:
                part.slot.view(out[part.slot.name]).copy_(
                    box_values(t.name, t.shape, part.box, seed=seed, step=step, dtype=dtype, device=device))
    return out


def train_shards(placements: Placements, rank: int, *, seed: int, step: int, dtype: torch.dtype,
                 device: Any = "cpu") -> dict[str, torch.Tensor]:
    """``rank``'s Megatron parameters (megatron-core names and storage layout) at ``step``."""
    return _fill(placements.train_storage[rank], lambda t: t.train, rank, placements,
                 seed=seed, step=step, dtype=dtype, device=device)


def expected_rollout_by_param(placements: Placements, rank: int, *, seed: int, step: int,
                              dtype: torch.dtype, device: Any = "cpu"):
    """Yield (vLLM name, expected tensor) one parameter at a time, so checking a 671B rank's
    shard never needs a second copy of the whole shard on the device."""
    by_slot: dict[str, list] = {}
    for t in placements.tensors:
        for part in t.rollout:
            if rank in part.ranks:
                by_slot.setdefault(part.slot.name, []).append((t, part))
    for name, shape in placements.rollout_storage[rank].items():
        want = torch.zeros(shape, dtype=dtype, device=device)
        for t, part in by_slot.get(name, ()):
            part.slot.view(want).copy_(
                box_values(t.name, t.shape, part.box, seed=seed, step=step, dtype=dtype, device=device))
        yield name, want


def update_in_place(placements: Placements, rank: int, params: dict[str, torch.Tensor], *, seed: int,
                    step: int) -> None:
    """The simulated optimizer step: every training parameter takes the values of ``step``."""
    for t in placements.tensors:
        for part in t.train:
            if rank in part.ranks:
                view = part.slot.view(params[part.slot.name])
                view.copy_(box_values(t.name, t.shape, part.box, seed=seed, step=step,
                                      dtype=view.dtype, device=view.device))
