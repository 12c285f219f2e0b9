"""Runs a reshard plan on one rank over torch.distributed (gloo, NCCL or HCCL through the
accelerator facade): local copies, then one all_to_all_single per bucket.

Senders pack boxes of their training storage straight into one flat send buffer; receivers
unpack the flat receive buffer straight into the rollout parameters (transposes and gate/up
fusion happen in those two copies). Nothing is ever materialised as a full tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verl_patches import accelerator
from verl_patches.reshard.layout import Box, Part, Placements
from verl_patches.reshard.planner import Plan, RankProgram, Transfer, rank_program

METHODS = ("direct", "recipe", "upstream")


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


def _rel(box: Box, part: Part) -> tuple[slice, ...]:
    return tuple(slice(a - pa, b - pa) for (a, b), (pa, _) in zip(box, part.box))


def _find(parts: list[Part], box: Box) -> Part:
    for p in parts:
        if all(pa <= a and b <= pb for (a, b), (pa, pb) in zip(box, p.box)):
            return p
    raise KeyError(f"no part holds box {box}")  # plan and placements disagree: a bug


def src_view(P: Placements, tr: Transfer, train: dict[str, torch.Tensor]) -> torch.Tensor:
    part = _find(P.tensors[tr[0]].train, tr[1])
    return part.slot.view(train[part.slot.name])[_rel(tr[1], part)]


def dst_view(P: Placements, tr: Transfer, roll: dict[str, torch.Tensor]) -> torch.Tensor:
    part = _find(P.tensors[tr[0]].rollout, tr[1])
    return part.slot.view(roll[part.slot.name])[_rel(tr[1], part)]


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def _program(plan: Plan, rank: int) -> RankProgram:
    cache = plan.__dict__.setdefault("_programs", {})
    if rank not in cache:
        cache[rank] = rank_program(plan, rank)
    return cache[rank]


def zero_padding(P: Placements, rank: int, roll: dict[str, torch.Tensor]) -> None:
    """vLLM zero-fills the vocab rows past the real vocabulary; do the same (no traffic)."""
    for slot in P.rollout_zero[rank]:
        slot.view(roll[slot.name]).zero_()


def check_inputs(P: Placements, rank: int, train: dict[str, torch.Tensor],
                 roll: dict[str, torch.Tensor]) -> None:
    for side, have, want in (("training", train, P.train_storage[rank]),
                             ("rollout", roll, P.rollout_storage[rank])):
        missing = sorted(set(want) - set(have))
        if missing:
            raise ValueError(f"rank {rank}: {side} parameters missing: {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
        for n, shp in want.items():
            if tuple(have[n].shape) != tuple(shp):
                raise ValueError(f"rank {rank}: {side} parameter {n} has shape {list(have[n].shape)}, "
                                 f"the layout says {list(shp)}")


def execute(plan: Plan, rank: int, train_shards: dict[str, torch.Tensor],
            rollout_params: dict[str, torch.Tensor], group: Any = None, method: str = "direct",
            check: bool = True) -> ExecStats:
    """Fill ``rollout_params`` (this rank's vLLM parameters, preallocated) from
    ``train_shards`` (its Megatron parameters). All ranks of the plan call it together with
    the same method. ``group`` is the world group (None: the default group)."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {METHODS}")
    P = plan.placements
    if check:
        check_inputs(P, rank, train_shards, rollout_params)
    if method == "upstream":
        from verl_patches.reshard.baselines import execute_upstream

        return execute_upstream(plan, rank, train_shards, rollout_params)
    if method == "recipe":
        from verl_patches.reshard.baselines import execute_recipe

        return execute_recipe(plan, rank, train_shards, rollout_params)
    return _execute_direct(plan, rank, train_shards, rollout_params, group)


def pack(plan: Plan, rank: int, bucket: int, train: dict[str, torch.Tensor], dtype: torch.dtype,
         device: Any) -> tuple[torch.Tensor, list[int]]:
    """This rank's flat send buffer of one bucket (ordered by destination peer, then plan
    order: the order in which each peer unpacks) and its per-peer split sizes."""
    P = plan.placements
    ssplit, _, send, _ = _program(plan, rank).buckets[bucket]
    sbuf = torch.empty(sum(ssplit), dtype=dtype, device=device)
    off = 0
    for tr in send:
        n = tr[4]
        sbuf[off:off + n].view(_shape(tr[1])).copy_(src_view(P, tr, train))
        off += n
    return sbuf, ssplit


def unpack(plan: Plan, rank: int, bucket: int, rbuf: torch.Tensor, roll: dict[str, torch.Tensor]) -> None:
    """Copy one bucket's receive buffer straight into the rollout parameters."""
    P = plan.placements
    _, _, _, recv = _program(plan, rank).buckets[bucket]
    off = 0
    for tr in recv:
        n = tr[4]
        dst_view(P, tr, roll).copy_(rbuf[off:off + n].view(_shape(tr[1])))
        off += n


def copy_local(plan: Plan, rank: int, train: dict[str, torch.Tensor], roll: dict[str, torch.Tensor]) -> int:
    """Boxes this rank already holds: copied without any traffic. Returns elements copied."""
    P = plan.placements
    n = 0
    for tr in _program(plan, rank).local:
        dst_view(P, tr, roll).copy_(src_view(P, tr, train))
        n += tr[4]
    return n


def _execute_direct(plan: Plan, rank: int, train: dict[str, torch.Tensor],
                    roll: dict[str, torch.Tensor], group: Any) -> ExecStats:
    P = plan.placements
    prog = _program(plan, rank)
    st = ExecStats("direct")
    t0 = time.perf_counter()
    ref = next(iter(roll.values()))
    zero_padding(P, rank, roll)
    st.local_bytes = copy_local(plan, rank, train, roll) * ref.element_size()
    for b, (_, rsplit, _, _) in enumerate(prog.buckets):
        sbuf, ssplit = pack(plan, rank, b, train, ref.dtype, ref.device)
        rbuf = torch.empty(sum(rsplit), dtype=ref.dtype, device=ref.device)
        dist.all_to_all_single(rbuf, sbuf, output_split_sizes=rsplit, input_split_sizes=ssplit,
                               group=group)
        unpack(plan, rank, b, rbuf, roll)
        es = sbuf.element_size()
        st.sent_bytes += sbuf.numel() * es
        st.recv_bytes += rbuf.numel() * es
        st.peak_extra_bytes = max(st.peak_extra_bytes, (sbuf.numel() + rbuf.numel()) * es)
        st.collectives += 1
        del sbuf, rbuf
    accelerator.synchronize()
    st.seconds = time.perf_counter() - t0
    return st
