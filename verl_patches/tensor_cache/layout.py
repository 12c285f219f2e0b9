"""Row layouts of a batch over ranks (generation layout, Megatron DP layout) and the exchange plan
that moves rows from the ranks holding them to the ranks wanting them. Pure torch, no communication.

A layout is, per rank, the ordered list of global row ids (sequence indices of the step's
batch) that the rank holds. The plan is computed identically on every rank from every rank's
held and wanted ids, so every rank agrees on who sends what without asking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


class LayoutError(ValueError):
    """A layout or an exchange request is inconsistent; the message names the rank and rows."""


def _ids(x: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.int64).reshape(-1)
    return t.cpu()


def generation_rows(batch: int, world: int, rank: int) -> torch.Tensor:
    """Rows rank ``rank`` holds after generation: verl's DP_COMPUTE_PROTO gives rank r the r-th of
    ``world`` equal contiguous chunks of the batch (DataProto.chunk refuses unequal chunks)."""
    if world <= 0 or not 0 <= rank < world:
        raise LayoutError(f"rank {rank} is outside a world of {world}")
    if batch % world:
        raise LayoutError(f"generation layout: batch of {batch} rows does not split into {world} equal chunks")
    per = batch // world
    return torch.arange(rank * per, (rank + 1) * per, dtype=torch.int64)


def megatron_dp_rows(batch: int, dp_size: int, dp_rank: int) -> torch.Tensor:
    """Rows every rank of Megatron data-parallel rank ``dp_rank`` holds: verl's
    MEGATRON_COMPUTE_PROTO chunks the batch into ``dp_size`` equal parts and gives part g to
    every rank whose data-parallel rank is g (its t*p*cp model-parallel replicas)."""
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise LayoutError(f"data-parallel rank {dp_rank} is outside a data-parallel size of {dp_size}")
    if batch % dp_size:
        raise LayoutError(f"Megatron layout: batch of {batch} rows does not split into {dp_size} equal DP chunks")
    per = batch // dp_size
    return torch.arange(dp_rank * per, (dp_rank + 1) * per, dtype=torch.int64)


@dataclass(frozen=True)
class ExchangePlan:
    """What one rank sends and receives in the single all-to-all.

    send_positions[p]: positions in this rank's held rows to send to peer p, in the order p wants them.
    recv_counts[p]: number of rows arriving from peer p.
    recv_slots: for the received rows in arrival order (peer 0's first, then peer 1's, ...), the
    position in this rank's wanted list where each one goes.
    needs_exchange: False when every rank holds all it wants (then no collective runs at all;
    the decision is the same on every rank because the plan is computed from the same inputs).
    local_positions: when needs_exchange is False, the held positions that give the wanted rows.
    """

    send_positions: tuple[torch.Tensor, ...]
    recv_counts: tuple[int, ...]
    recv_slots: torch.Tensor
    needs_exchange: bool
    local_positions: torch.Tensor | None

    @property
    def send_counts(self) -> tuple[int, ...]:
        return tuple(int(s.numel()) for s in self.send_positions)


def _local_index(held: torch.Tensor, n_ids: int) -> torch.Tensor:
    pos = torch.full((n_ids,), -1, dtype=torch.int64)
    pos[held] = torch.arange(held.numel(), dtype=torch.int64)
    return pos


def _sources(held: list[torch.Tensor], wanted: torch.Tensor, dst: int, n_ids: int,
             holders: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(source rank, position in the source's held rows) for each row ``dst`` wants.

    A row held by the destination itself is copied locally (no link traffic); a row held by
    several other ranks (replicas) is taken from replica ``dst mod copies`` so that replicas share
    the sending."""
    count, start, rank_sorted, pos_sorted = holders
    if wanted.numel() == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    if int(wanted.min()) < 0 or int(wanted.max()) >= n_ids or bool((count[wanted] == 0).any()):
        missing = [int(i) for i in wanted if i < 0 or i >= n_ids or count[i] == 0][:8]
        raise LayoutError(f"rank {dst} wants rows {missing} that no rank holds")
    own = _local_index(held[dst], n_ids)[wanted]
    pick = start[wanted] + torch.remainder(torch.full_like(wanted, dst), count[wanted])
    src = torch.where(own >= 0, torch.full_like(wanted, dst), rank_sorted[pick])
    pos = torch.where(own >= 0, own, pos_sorted[pick])
    return src, pos


def plan_exchange(held: Sequence[Sequence[int] | torch.Tensor], wanted: Sequence[Sequence[int] | torch.Tensor],
                  rank: int) -> ExchangePlan:
    """The exchange plan of ``rank``, given every rank's held and wanted row ids (same on all ranks)."""
    world = len(held)
    if len(wanted) != world:
        raise LayoutError(f"held rows given for {world} ranks but wanted rows for {len(wanted)}")
    if not 0 <= rank < world:
        raise LayoutError(f"rank {rank} is outside a world of {world}")
    held_t = [_ids(h) for h in held]
    wanted_t = [_ids(w) for w in wanted]
    for r, h in enumerate(held_t):
        if h.numel() and (int(h.min()) < 0):
            raise LayoutError(f"rank {r} holds negative row ids")
        if h.unique().numel() != h.numel():
            raise LayoutError(f"rank {r} holds some rows twice")
    n_ids = 1 + max([int(h.max()) for h in held_t if h.numel()] + [int(w.max()) for w in wanted_t if w.numel()] + [-1])

    all_ids = torch.cat(held_t) if held_t else torch.empty(0, dtype=torch.int64)
    all_rank = torch.cat([torch.full((h.numel(),), r, dtype=torch.int64) for r, h in enumerate(held_t)])
    all_pos = torch.cat([torch.arange(h.numel(), dtype=torch.int64) for h in held_t])
    order = torch.argsort(all_ids * max(world, 1) + all_rank, stable=True)
    count = torch.bincount(all_ids, minlength=n_ids)
    start = torch.cumsum(count, 0) - count
    holders = (count, start, all_rank[order], all_pos[order])

    # Global decision: an exchange is needed if any rank wants a row it does not hold itself.
    needs = False
    for dst in range(world):
        if wanted_t[dst].numel() and bool((_local_index(held_t[dst], n_ids)[wanted_t[dst]] < 0).any()):
            needs = True
            break
    if not needs:
        _, pos = _sources(held_t, wanted_t[rank], rank, n_ids, holders)
        return ExchangePlan(tuple(torch.empty(0, dtype=torch.int64) for _ in range(world)), (0,) * world,
                            torch.empty(0, dtype=torch.int64), False, pos)

    send: list[torch.Tensor] = []
    for dst in range(world):
        src, pos = _sources(held_t, wanted_t[dst], dst, n_ids, holders)
        send.append(pos[src == rank])
    src_me, _ = _sources(held_t, wanted_t[rank], rank, n_ids, holders)
    recv_counts = tuple(int((src_me == p).sum()) for p in range(world))
    # Arrival order: by source rank, and within a source in the order this rank wants them.
    recv_slots = torch.argsort(src_me, stable=True)
    return ExchangePlan(tuple(send), recv_counts, recv_slots, True, None)
