"""Ours, method ``direct``: runs a reshard plan on one rank over torch.distributed (gloo, NCCL or HCCL through the
accelerator facade): one all_to_all_single per bucket, two buckets in flight, local copies.

Senders pack boxes of their training storage straight into one flat send buffer; receivers
unpack the flat receive buffer straight into the rollout parameters (transposes and gate/up
fusion happen in those two copies). Nothing is ever materialised as a full tensor.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from verl_patches.base import accelerator
from verl_patches.reshard.copyops import copy_into
from verl_patches.reshard.box import Box
from verl_patches.reshard.placements import Part, Placements, zero_padding
from verl_patches.reshard.stats import ExecStats
from verl_patches.reshard.planner import Plan, RankProgram, Transfer, rank_program


def _rel(box: Box, part: Part) -> tuple[slice, ...]:
    return tuple(slice(a - pa, b - pa) for (a, b), (pa, _) in zip(box, part.box))


def _find(parts: list[Part], box: Box) -> Part:
    for p in parts:
        if all(pa <= a and b <= pb for (a, b), (pa, pb) in zip(box, p.box)):
            return p
    raise KeyError(f"no part holds box {box}")  # plan and placements disagree: a bug


def src_view(P: Placements, tr: Transfer, train: dict[str, torch.Tensor]) -> torch.Tensor:
    part = _find(P.tensors[tr.tensor].train, tr.box)
    return part.slot.view(train[part.slot.name])[_rel(tr.box, part)]


def dst_view(P: Placements, tr: Transfer, roll: dict[str, torch.Tensor]) -> torch.Tensor:
    part = _find(P.tensors[tr.tensor].rollout, tr.box)
    return part.slot.view(roll[part.slot.name])[_rel(tr.box, part)]


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def _program(plan: Plan, rank: int) -> RankProgram:
    cache = plan.__dict__.setdefault("_programs", {})
    if rank not in cache:
        cache[rank] = rank_program(plan, rank)
    return cache[rank]


def prepare(plan: Plan, rank: int) -> None:
    """Build this rank's transfer program now (plan once per run, outside any timed region)."""
    _program(plan, rank)


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


def pack(plan: Plan, rank: int, bucket: int, train: dict[str, torch.Tensor], dtype: torch.dtype,
         device: Any, out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """This rank's flat send buffer of one bucket (ordered by destination peer, then plan
    order: the order in which each peer unpacks) and its per-peer split sizes. Written into
    the front of ``out`` when given."""
    P = plan.placements
    ssplit, _, send, _ = _program(plan, rank).buckets[bucket]
    n_all = sum(ssplit)
    sbuf = torch.empty(n_all, dtype=dtype, device=device) if out is None else out[:n_all]
    off = 0
    for tr in send:
        n = tr.numel
        copy_into(sbuf[off:off + n].view(_shape(tr.box)), src_view(P, tr, train))
        off += n
    return sbuf, ssplit


def unpack(plan: Plan, rank: int, bucket: int, rbuf: torch.Tensor, roll: dict[str, torch.Tensor]) -> None:
    """Copy one bucket's receive buffer straight into the rollout parameters."""
    P = plan.placements
    _, _, _, recv = _program(plan, rank).buckets[bucket]
    off = 0
    for tr in recv:
        n = tr.numel
        copy_into(dst_view(P, tr, roll), rbuf[off:off + n].view(_shape(tr.box)))
        off += n


def copy_local(plan: Plan, rank: int, train: dict[str, torch.Tensor], roll: dict[str, torch.Tensor]) -> int:
    """Boxes this rank already holds: copied without any traffic. Returns elements copied."""
    P = plan.placements
    n = 0
    for tr in _program(plan, rank).local:
        copy_into(dst_view(P, tr, roll), src_view(P, tr, train))
        n += tr.numel
    return n


def _local_chunks(local: list[Transfer], n: int) -> list[list[Transfer]]:
    """Local copies cut into n groups of about equal bytes, one issued per bucket so that they
    run while the links are busy."""
    n = max(1, n)
    total = sum(t.numel for t in local) or 1
    out: list[list[Transfer]] = [[] for _ in range(n)]
    acc = 0
    for t in local:
        out[min(n - 1, acc * n // total)].append(t)
        acc += t.numel
    return out


def execute_direct(plan: Plan, rank: int, train: dict[str, torch.Tensor],
                   roll: dict[str, torch.Tensor], group: Any = None, in_flight: int = 2) -> ExecStats:
    """Fill ``roll`` (this rank's vLLM parameters, preallocated) from ``train`` (its Megatron parameters) by the
    plan's direct slice routing; all ranks of the plan call it together. ``in_flight`` buckets on the links (two by default): bucket b+1 is packed and its
    all-to-all queued while bucket b is on the links; bucket b is unpacked once its all-to-all is
    done (work.wait() orders the device stream after the collective without blocking the host),
    and its staging buffer then takes bucket b + in_flight. Local copies are spread over the
    buckets so they overlap the transfers too."""
    P = plan.placements
    prog = _program(plan, rank)
    st = ExecStats("direct")
    t0 = time.perf_counter()
    ref = next(iter(roll.values()))
    es = ref.element_size()
    zero_padding(P, rank, roll)
    nb = len(prog.buckets)
    local = _local_chunks(prog.local, nb)
    # in_flight staging buffers allocated once, each holding one bucket's send and receive parts:
    # the extra memory is exactly in_flight buckets (no per-bucket allocation, no allocator rounding).
    size = max((sum(ss) + sum(rs) for ss, rs, _, _ in prog.buckets), default=0)
    stage = [torch.empty(size, dtype=ref.dtype, device=ref.device) for _ in range(min(in_flight, nb))]
    st.peak_extra_bytes = size * len(stage) * es
    inflight: list[tuple[int, Any, torch.Tensor]] = []

    def issue(b: int) -> None:
        rsplit = prog.buckets[b][1]
        buf = stage[b % len(stage)]
        sbuf, ssplit = pack(plan, rank, b, train, ref.dtype, ref.device, out=buf)
        rbuf = buf[sbuf.numel():sbuf.numel() + sum(rsplit)]
        work = dist.all_to_all_single(rbuf, sbuf, output_split_sizes=rsplit, input_split_sizes=ssplit,
                                      group=group, async_op=True)
        inflight.append((b, work, rbuf))
        st.sent_bytes += sbuf.numel() * es
        st.recv_bytes += rbuf.numel() * es
        st.collectives += 1

    def retire() -> None:
        b, work, rbuf = inflight.pop(0)
        work.wait()
        unpack(plan, rank, b, rbuf, roll)

    if nb == 0:
        copy_local(plan, rank, train, roll)
    for b in range(nb):
        if len(inflight) == len(stage):
            retire()
        issue(b)
        for tr in local[b]:
            copy_into(dst_view(P, tr, roll), src_view(P, tr, train))
    while inflight:
        retire()
    st.local_bytes = sum(t.numel for t in prog.local) * es
    accelerator.synchronize()
    st.seconds = time.perf_counter() - t0
    return st
