"""verl 0.4.1's weight update (method ``upstream``) on the same placements and tensors as the direct plan, executed
and costed, for comparison; and what both reference methods read (units, groups, the shared first step).
The reference recipe's AlltoAllV (method ``alltoallv``) is verl_patches/reshard/alltoallv.py.

verl 0.4.1 (verl/utils/megatron_utils.py per_tensor_generator): per Megatron parameter in PP order,
broadcast the owner stage's shard over PP, all-gather over TP (or over the expert group for
experts), build the full tensor, and let the loader slice the rollout part out of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_patches.base import accelerator
from verl_patches.reshard.copyops import copy_into

from verl_patches.reshard.placements import Logical, Placements, zero_padding
from verl_patches.reshard.stats import ExecStats
from verl_patches.reshard.planner import Plan, RankStats


# --------------------------------------------------------------------------------------
# Units: one Megatron parameter of one stage (what upstream iterates over)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    stage: int
    name: str  # Megatron storage name (stage-local numbering)
    kind: str | None  # None (replicated in the stage), "tp" or "ep"
    tids: tuple[int, ...]  # logical tensors stored in it
    shard_numel: int  # elements of the stored shard (padding included)


def units(P: Placements) -> list[Unit]:
    cache = P.__dict__.setdefault("_units", None)
    if cache is not None:
        return cache
    order: dict[tuple[int, str], list[int]] = {}
    kinds: dict[tuple[int, str], str | None] = {}
    for tid, lt in enumerate(P.tensors):
        key = (lt.stage, lt.train[0].slot.name)
        order.setdefault(key, []).append(tid)
        kinds[key] = lt.gather
    out = []
    for (s, name), tids in sorted(order.items(), key=lambda kv: (kv[0][0], kv[1][0])):
        holder = P.tensors[tids[0]].train[0].ranks[0]
        shape = P.train_storage[holder][name]
        n = 1
        for x in shape:
            n *= x
        out.append(Unit(s, name, kinds[(s, name)], tuple(tids), n))
    P.__dict__["_units"] = out
    return out


@dataclass
class Groups:
    """This rank's TP, PP and expert process groups (built once, by every rank, in order)."""

    tp: Any
    pp: Any
    ep: Any
    tp_ranks: list[int]
    pp_ranks: list[int]
    ep_ranks: list[int]


def make_groups(P: Placements, rank: int) -> Groups:
    cache = P.__dict__.setdefault("_groups", {})
    if rank in cache:
        return cache[rank]
    tc = P.tcoords
    mine: dict[str, tuple[Any, list[int]]] = {}
    for kind, groups in (("tp", tc.tp_groups), ("pp", tc.pp_groups), ("ep", tc.expert_groups)):
        for g in groups:
            pg = dist.new_group(g)  # collective: every rank creates every group
            if rank in g:
                mine[kind] = (pg, g)
    out = Groups(mine["tp"][0], mine["pp"][0], mine["ep"][0], mine["tp"][1], mine["pp"][1], mine["ep"][1])
    cache[rank] = out
    return out


def needs(P: Placements, rank: int) -> dict[int, list[Any]]:
    """logical tensor id -> rollout parts this rank needs"""
    cache = P.__dict__.setdefault("needs", {})
    if rank not in cache:
        d: dict[int, list[Any]] = {}
        for tid, lt in enumerate(P.tensors):
            for part in lt.rollout:
                if rank in part.ranks:
                    d.setdefault(tid, []).append(part)
        cache[rank] = d
    return cache[rank]


def sl(box: Any) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def full_from_shards(lt: Logical, shards: list[torch.Tensor]) -> torch.Tensor:
    full = torch.empty(lt.shape, dtype=shards[0].dtype, device=shards[0].device)
    for part in lt.train:
        copy_into(full[sl(part.box)], part.slot.view(shards[part.shard]))
    return full


def load_from_full(P: Placements, rank: int, tid: int, full: torch.Tensor,
                    roll: dict[str, torch.Tensor]) -> None:
    # What vLLM's load_weights does with a full tensor: narrow out this rank's part.
    for part in needs(P, rank).get(tid, []):
        copy_into(part.slot.view(roll[part.slot.name]), full[sl(part.box)])


class Peak:
    def __init__(self) -> None:
        self.cur = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.cur += n
        self.peak = max(self.peak, self.cur)

    def sub(self, n: int) -> None:
        self.cur -= n


# --------------------------------------------------------------------------------------
# A: upstream verl 0.4.1
# --------------------------------------------------------------------------------------


def stage_shard(P: Placements, G: Any, u: Any, my_stage: int, train: dict[str, torch.Tensor],
                 ref: torch.Tensor, peak: "Peak", st: Any) -> torch.Tensor:
    """Unit u's shard as its owner stage holds it, on every stage (one PP broadcast); a stage
    other than the owner's counts the buffer in the peak until the caller releases it."""
    owner = G.pp_ranks[u.stage]
    if my_stage == u.stage:
        buf = train[u.name]
    else:
        buf = torch.empty(P.train_storage[owner][u.name], dtype=ref.dtype, device=ref.device)
        peak.add(u.shard_numel * ref.element_size())
    if P.train.pp > 1:
        dist.broadcast(buf, src=owner, group=G.pp)
        st.collectives += 1
        if my_stage != u.stage:
            st.recv_bytes += u.shard_numel * ref.element_size()
    return buf


def begin(plan: Plan, rank: int, roll: dict[str, torch.Tensor], method: str):
    """What both reference methods begin with: the placements, this rank's groups, the method's stats, the
    peak counter, the clock, a rollout tensor (its dtype, device and element size) and this rank's pipeline
    stage; the rollout's vocab padding zeroed."""
    P = plan.placements
    G = make_groups(P, rank)
    st = ExecStats(method)
    peak = Peak()
    t0 = time.perf_counter()
    ref = next(iter(roll.values()))
    my_stage = P.tcoords.pp_rank[rank]
    zero_padding(P, rank, roll)
    return P, G, st, peak, t0, ref, ref.element_size(), my_stage


def execute_upstream(plan: Plan, rank: int, train: dict[str, torch.Tensor],
                     roll: dict[str, torch.Tensor]) -> ExecStats:
    P, G, st, peak, t0, ref, es, my_stage = begin(plan, rank, roll, "upstream")
    for u in units(P):
        buf = stage_shard(P, G, u, my_stage, train, ref, peak, st)
        g = len(G.tp_ranks) if u.kind == "tp" else len(G.ep_ranks) if u.kind == "ep" else 1
        if g > 1:
            shards = [torch.empty_like(buf) for _ in range(g)]
            peak.add(g * u.shard_numel * es)
            dist.all_gather(shards, buf, group=G.tp if u.kind == "tp" else G.ep)
            st.collectives += 1
            st.recv_bytes += (g - 1) * u.shard_numel * es
        else:
            shards = [buf]
        for tid in u.tids:
            lt = P.tensors[tid]
            full = full_from_shards(lt, shards)
            peak.add(lt.numel * es)
            load_from_full(P, rank, tid, full, roll)
            del full
            peak.sub(lt.numel * es)
        if g > 1:
            peak.sub(g * u.shard_numel * es)
        if my_stage != u.stage:
            peak.sub(u.shard_numel * es)
        del shards, buf
    accelerator.synchronize()
    st.seconds = time.perf_counter() - t0
    st.peak_extra_bytes = peak.peak
    return st


def upstream_stats(P: Placements, elem_size: int) -> list[RankStats]:
    """Bytes, collectives and transient memory of A per rank, from metadata alone."""
    W, tc = P.world, P.tcoords
    t, te, p = P.train.tp, P.train.tp * P.train.ep, P.train.pp
    out = [RankStats() for _ in range(W)]
    # Depends only on a rank's stage: compute per stage, then copy.
    per_stage = []
    for s in range(p):
        recv = coll = pk = 0
        for u in units(P):
            g = t if u.kind == "tp" else te if u.kind == "ep" else 1
            bc = u.shard_numel if s != u.stage else 0
            if p > 1:
                coll += 1
                recv += bc
            if g > 1:
                coll += 1
                recv += (g - 1) * u.shard_numel
            big = max(P.tensors[i].numel for i in u.tids)
            pk = max(pk, bc + (g * u.shard_numel if g > 1 else 0) + big)
        per_stage.append((recv, coll, pk))
    for r in range(W):
        recv, coll, pk = per_stage[tc.pp_rank[r]]
        out[r].recv_bytes = recv * elem_size
        out[r].collectives = coll
        out[r].peak_extra_bytes = pk * elem_size
    return out
