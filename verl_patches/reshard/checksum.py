"""The weight fingerprint: after every reshard, proof that each rollout parameter holds exactly what
the training side implies for it, computed on the device, bit for bit.

The checksum of a parameter ``T`` (any layout, any dtype) is

    C(T) = sum_i bits(T_i) * k(i)   (mod M)

where ``i`` is the element's flat row-major index in ``T``, ``bits`` its raw bit pattern as a
signed integer (bf16/fp16: 16 bits; fp32: 32 bits reduced mod M first) and ``k`` a key in
[1, 65521] that changes with the position (``_keys``). It is exact integer arithmetic, so:
- it is order free: the rollout rank sums its parameter in chunks; every training rank sums the
  boxes it sends at their *destination* offsets; the partial sums add up along the plan (one
  all-reduce) to the same integer, with no tolerance;
- it is position sensitive: an element written to the wrong place (a transpose, a shifted row, a
  swapped expert) changes the sum, unless the two values are bit-equal or the keys collide.

The destination offsets come from the plan's own placements applied to a *meta* tensor of the
rollout parameter's shape (``Slot.view`` is reshape / narrow / permute, all true views), so the
sender never needs the rollout tensor, and the check does not reuse the executor's copy path:
it asks "which element of vLLM's parameter should hold this training element", from the
placements, and the rollout side answers from the raw parameter. Padding the rollout zero-fills
(vocab rows) contributes nothing and must therefore be zero.

Cost (measured by scripts/bench_fingerprint.py, figures in docs/benchmarks.md): one read of every
rollout byte on the receiving rank, one read of every sent byte on the sending ranks, a few integer
ops per element, temporaries bounded by ``chunk`` elements, and one all-reduce of 8 bytes per
(rank, parameter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist

from verl_patches.reshard.box import Box
from verl_patches.reshard.planner import Plan, Transfer

MOD = (1 << 31) - 1  # the checksum's modulus (a prime): chunk sums of bits x keys stay far below 2**63
_P, _A, _B = 65521, 40503, 29017  # keys: k(i) = ((i mod P) * A + (i div P) * B) mod P + 1
CHUNK = 1 << 22  # elements per chunk: bounds the int64 temporaries (32 MiB each)


class WeightMismatchError(RuntimeError):
    """A rollout parameter does not hold what the training side sent it; the message names the step,
    rollout rank, parameter, expected and found checksums."""


def _keys(index: torch.Tensor) -> torch.Tensor:
    """Position keys in [1, P] for flat indices (int64, any shape)."""
    return torch.remainder(torch.remainder(index, _P) * _A + torch.div(index, _P, rounding_mode="floor") * _B, _P) + 1


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as int64 (any layout, same shape)."""
    size = values.element_size()
    if size == 2:
        return values.view(torch.int16).to(torch.int64)
    if size == 4:
        return torch.remainder(values.view(torch.int32).to(torch.int64), MOD)
    raise TypeError(f"weight fingerprint: dtype {values.dtype} is not a 2- or 4-byte type")


def _weighted_sum(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """sum(bits(values) * k(index)) mod M as a 0-dim int64 tensor on values' device."""
    return torch.remainder((_bits(values) * _keys(index)).sum(), MOD)


def tensor_checksum(t: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """C(t) over t's own flat row-major index, as a 0-dim int64 tensor (no host sync)."""
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk]
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=t.device)
        total = torch.remainder(total + _weighted_sum(part, index), MOD)
    return total


def view_checksum(values: torch.Tensor, dest: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """sum(bits(values) * k(flat index in the destination)) mod M, where ``dest`` is a view (of the
    same shape as ``values``) into a meta tensor of the destination's shape: its storage offset and
    strides give each element's flat index there."""
    if tuple(values.shape) != tuple(dest.shape):
        raise ValueError(f"weight fingerprint: values {tuple(values.shape)} vs destination {tuple(dest.shape)}")
    device = values.device
    total = torch.zeros((), dtype=torch.int64, device=device)
    if values.numel() == 0:
        return total
    if values.dim() == 0:
        return _weighted_sum(values.reshape(1), torch.tensor([dest.storage_offset()], device=device))
    # Offsets of the trailing dims, broadcast; the leading dim is walked in chunks of rows.
    rest = torch.zeros((), dtype=torch.int64, device=device)
    for d in range(1, values.dim()):
        shape = [1] * (values.dim() - 1)
        shape[d - 1] = values.shape[d]
        rest = rest + (torch.arange(values.shape[d], dtype=torch.int64, device=device) * dest.stride(d)).view(shape)
    row = max(1, math.prod(values.shape[1:]))
    rows = max(1, chunk // row)
    for a in range(0, values.shape[0], rows):
        b = min(values.shape[0], a + rows)
        lead = (torch.arange(a, b, dtype=torch.int64, device=device) * dest.stride(0)).view([-1] + [1] * (values.dim() - 1))
        index = dest.storage_offset() + lead + rest
        total = torch.remainder(total + _weighted_sum(values[a:b], index), MOD)
    return total


def _rel(box: Box, part_box: Box) -> tuple[slice, ...]:
    return tuple(slice(a - pa, b - pa) for (a, b), (pa, _) in zip(box, part_box))


@dataclass
class FingerprintTable:
    """One slot per (rollout rank, parameter) of the plan, in a fixed order every rank agrees on."""

    names: list[list[str]]  # per rollout rank: its parameter names, sorted
    offsets: list[int]  # per rank: index of its first slot
    size: int
    meta: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: Plan) -> "FingerprintTable":
        cached = plan.__dict__.get("_fingerprint_table")
        if cached is None:
            names = [sorted(s) for s in plan.placements.rollout_storage]
            offsets, n = [], 0
            for ns in names:
                offsets.append(n)
                n += len(ns)
            cached = plan.__dict__["_fingerprint_table"] = cls(names, offsets, n)
        return cached

    def slot(self, rank: int, name: str) -> int:
        return self.offsets[rank] + self.names[rank].index(name)

    def dest_view(self, plan: Plan, tr: Transfer) -> tuple[str, torch.Tensor]:
        """(parameter name, meta view of the box in the destination rank's parameter)."""
        part = next((p for p in plan.placements.tensors[tr.tensor].rollout if tr.dst in p.ranks and
                     all(pa <= a and b <= pb for (a, b), (pa, pb) in zip(tr.box, p.box))), None)
        if part is None:
            raise KeyError(f"weight fingerprint: no rollout part of rank {tr.dst} holds box {tr.box} of "
                           f"{plan.placements.tensors[tr.tensor].name}")  # plan and placements disagree: a bug
        name = part.slot.name
        key = (tr.dst, name)
        if key not in self.meta:
            self.meta[key] = torch.empty(plan.placements.rollout_storage[tr.dst][name], device="meta")
        return name, part.slot.view(self.meta[key])[_rel(tr.box, part.box)]


@dataclass
class FingerprintResult:
    params: int  # rollout parameters compared on this rank
    bytes_read: int  # bytes this rank read for the check (its rollout shard + what it sent)
    seconds: float


def _sent_by(plan: Plan, rank: int) -> list[Transfer]:
    cache = plan.__dict__.setdefault("_fingerprint_sends", {})
    if rank not in cache:
        cache[rank] = [t for t in plan.local if t.src == rank] + [t for b in plan.buckets for t in b if t.src == rank]
    return cache[rank]


def verify(plan: Plan, rank: int, train: Mapping[str, torch.Tensor], roll: Mapping[str, torch.Tensor], *,
           step: Any = None, group: Any = None, chunk: int = CHUNK) -> FingerprintResult:
    """Compare every rollout parameter of every rank with what the training side implies (all ranks
    call it together, after the reshard, with the training tensors it read). Raises
    WeightMismatchError on every rank when any rank differs."""
    import time

    from verl_patches import accelerator
    from verl_patches.reshard.executor import src_view

    t0 = time.perf_counter()
    P = plan.placements
    table = FingerprintTable.of(plan)
    device = next(iter(roll.values())).device
    expected = torch.zeros(table.size, dtype=torch.int64, device=device)
    read = 0
    slots, sums = [], []
    for tr in _sent_by(plan, rank):
        name, dest = table.dest_view(plan, tr)
        values = src_view(P, tr, dict(train))
        slots.append(table.slot(tr.dst, name))
        sums.append(view_checksum(values, dest, chunk))
        read += values.numel() * values.element_size()
    if sums:
        expected.index_add_(0, torch.tensor(slots, dtype=torch.int64, device=device), torch.stack(sums))
    mine = table.names[rank]
    found = torch.stack([tensor_checksum(roll[n], chunk) for n in mine]) if mine else expected[:0]
    read += sum(roll[n].numel() * roll[n].element_size() for n in mine)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(expected, group=group)
    expected = torch.remainder(expected, MOD)
    lo = table.offsets[rank]
    bad = (expected[lo:lo + len(mine)] != found).nonzero().flatten().tolist()
    mismatches = [(rank, mine[i], int(expected[lo + i]), int(found[i])) for i in bad]
    mismatches = _everyone(mismatches, group, device)
    if mismatches:
        where = f"step {step}" if step is not None else "this switch"
        lines = [f"rollout rank {r}, {n}: expected {e:#010x}, found {f:#010x}" for r, n, e, f in mismatches[:8]]
        more = f" (and {len(mismatches) - 8} more)" if len(mismatches) > 8 else ""
        raise WeightMismatchError(
            f"weight fingerprint at {where}: {len(mismatches)} rollout parameter(s) do not hold what the training "
            f"side sent{more}:\n  " + "\n  ".join(lines) +
            "\nThe rollout would generate from other weights than the trainer's. Compare the reshard method "
            "(actor_rollout_ref.rollout.recipe.reshard_method) and the engine's weight layout; this check is "
            "actor_rollout_ref.rollout.recipe.fingerprint_every")
    accelerator.synchronize()
    return FingerprintResult(len(mine), read, time.perf_counter() - t0)


def _everyone(items: list, group: Any, device: torch.device) -> list:
    """Every rank's items, on every rank (one flag all-reduce; an object gather only when any)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return items
    flag = torch.tensor([len(items)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, group=group)
    if int(flag.item()) == 0:
        return []
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, items, group=group)
    return sorted(x for g in gathered for x in g)

