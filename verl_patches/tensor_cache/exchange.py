"""Move named row-tensors between data-parallel layouts with one all_to_all_single (AlltoAllV).

All tensors of a move share their rows (dim 0); every row of every tensor is packed as raw bytes
into one send buffer, so the move is bit-exact for any dtype and costs one collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from verl_patches.tensor_cache.layout import ExchangePlan, LayoutError, plan_exchange


@dataclass(frozen=True)
class MoveStats:
    """What one move did on this rank (for logs and tests)."""

    exchanged: bool  # False: no collective ran (every rank already held what it wanted)
    rows_sent: int
    rows_received: int
    bytes_sent: int
    bytes_received: int


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[rows, row bytes] uint8 view of a row-tensor (a copy only if it is not contiguous)."""
    rows = t.shape[0]
    flat = t.contiguous().reshape(rows, -1) if t.dim() > 1 else t.contiguous().reshape(rows, 1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _from_bytes(b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    rows = b.shape[0]
    out = b.contiguous()
    if like.dtype != torch.uint8:
        out = out.view(like.dtype)
    return out.reshape(rows, *like.shape[1:])


def gather_layouts(held: torch.Tensor, wanted: torch.Tensor, row_bytes: int, device: torch.device,
                   group: dist.ProcessGroup | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's held and wanted row ids (two small all_gathers on the data's device).

    Also checks that every rank packs rows of the same byte size (same tensors, dtypes and row
    shapes): a mismatch would silently scramble the bytes, so it is an error naming the ranks."""
    world = dist.get_world_size(group)
    meta = torch.tensor([held.numel(), wanted.numel(), row_bytes], dtype=torch.int64, device=device)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    metas_l = [m.cpu().tolist() for m in metas]
    sizes = {m[2] for m in metas_l}
    if len(sizes) > 1:
        detail = ", ".join(f"rank {r}: {m[2]}" for r, m in enumerate(metas_l))
        raise LayoutError(f"ranks pack rows of different byte sizes ({detail}): the cached tensors differ between ranks")
    width = max(max(m[0], m[1]) for m in metas_l) if metas_l else 0
    both = torch.full((2, width), -1, dtype=torch.int64, device=device)
    both[0, : held.numel()] = held.to(device)
    both[1, : wanted.numel()] = wanted.to(device)
    alls = [torch.empty_like(both) for _ in range(world)]
    dist.all_gather(alls, both, group=group)
    held_all = [a[0, : m[0]].cpu() for a, m in zip(alls, metas_l)]
    wanted_all = [a[1, : m[1]].cpu() for a, m in zip(alls, metas_l)]
    return held_all, wanted_all


def apply_plan(tensors: Mapping[str, torch.Tensor], plan: ExchangePlan, n_wanted: int,
               group: dist.ProcessGroup | None = None) -> tuple[dict[str, torch.Tensor], MoveStats]:
    """Run a plan: local gather when no exchange is needed, else one all_to_all_single of raw bytes."""
    names = sorted(tensors)
    if not plan.needs_exchange:
        assert plan.local_positions is not None
        out = {}
        for n in names:
            idx = plan.local_positions.to(tensors[n].device)
            t = tensors[n]
            # Identity selections keep the tensor as it is (the common reference -> update case).
            out[n] = t if idx.numel() == t.shape[0] and bool((idx == torch.arange(t.shape[0], device=idx.device)).all()) \
                else t.index_select(0, idx)
        return out, MoveStats(False, 0, 0, 0, 0)

    device = tensors[names[0]].device
    send_idx = torch.cat(list(plan.send_positions)).to(device)
    parts = [_as_bytes(tensors[n].index_select(0, send_idx)) for n in names]
    widths = [p.shape[1] for p in parts]
    send_buf = torch.cat(parts, dim=1) if parts else torch.empty(0, 0, dtype=torch.uint8, device=device)
    recv_rows = sum(plan.recv_counts)
    recv_buf = torch.empty(recv_rows, send_buf.shape[1], dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv_buf, send_buf, output_split_sizes=list(plan.recv_counts),
                           input_split_sizes=list(plan.send_counts), group=group)
    if recv_rows != n_wanted:
        raise LayoutError(f"received {recv_rows} rows but {n_wanted} were wanted")
    slots = plan.recv_slots.to(device)
    out = {}
    col = 0
    for n, w in zip(names, widths):
        arrived = _from_bytes(recv_buf[:, col: col + w], tensors[n])
        col += w
        placed = torch.empty((n_wanted, *tensors[n].shape[1:]), dtype=tensors[n].dtype, device=device)
        placed[slots] = arrived
        out[n] = placed
    row_b = int(send_buf.shape[1])
    return out, MoveStats(True, int(send_idx.numel()), recv_rows, int(send_idx.numel()) * row_b, recv_rows * row_b)


def relayout(tensors: Mapping[str, torch.Tensor], held: torch.Tensor, wanted: torch.Tensor,
             group: dist.ProcessGroup | None = None) -> tuple[dict[str, torch.Tensor], MoveStats]:
    """Give this rank the rows ``wanted`` (global ids, in that order) of every tensor, where each
    rank currently holds the rows ``held``. Collective: every rank of ``group`` must call it."""
    if not tensors:
        raise LayoutError("nothing to move: no tensors given")
    held = torch.as_tensor(held, dtype=torch.int64).reshape(-1).cpu()
    wanted = torch.as_tensor(wanted, dtype=torch.int64).reshape(-1).cpu()
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise LayoutError(f"tensors are on several devices {sorted(map(str, devices))}; move them to one first")
    for n, t in tensors.items():
        if t.dim() == 0 or t.shape[0] != held.numel():
            raise LayoutError(f"tensor {n!r} has {t.shape[0] if t.dim() else 0} rows, the layout holds {held.numel()}")
    device = next(iter(devices))
    row_bytes = sum(_row_bytes(t) for t in tensors.values())
    held_all, wanted_all = gather_layouts(held, wanted, row_bytes, device, group)
    plan = plan_exchange(held_all, wanted_all, dist.get_rank(group))
    return apply_plan(tensors, plan, wanted.numel(), group)
