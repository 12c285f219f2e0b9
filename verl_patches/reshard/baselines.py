"""The two reference reshard methods on the same placements and tensors as the direct plan:
A "upstream" (verl 0.4.1) and B "recipe" (the reference Ascend recipe), executed and costed.

A (verl/utils/megatron_utils.py per_tensor_generator): per Megatron parameter in PP order,
broadcast the owner stage's shard over PP, all-gather over TP (or over the expert group for
experts), build the full tensor, and let the loader slice the rollout part out of it.
B: experts by a PP broadcast of the expert-group shards and one AlltoAllV inside the expert
group (each rank receives only the experts it hosts); dense tensors by a TP all-gather in the
owner stage and one PP all-to-all that spreads the gathered full tensors to every stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verl_patches.base import accelerator
from verl_patches.reshard.copyops import copy_into
from verl_patches.reshard.box import box_numel, intersect
from verl_patches.reshard.placements import Logical, Placements
from verl_patches.reshard.planner import Plan, RankStats, summarize


# What one rank's reshard did (shared by every method's executor, ours in executor.py too), and the one
# step all of them end with.
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


def _needs(P: Placements, rank: int) -> dict[int, list[Any]]:
    """logical tensor id -> rollout parts this rank needs"""
    cache = P.__dict__.setdefault("_needs", {})
    if rank not in cache:
        d: dict[int, list[Any]] = {}
        for tid, lt in enumerate(P.tensors):
            for part in lt.rollout:
                if rank in part.ranks:
                    d.setdefault(tid, []).append(part)
        cache[rank] = d
    return cache[rank]


def _sl(box: Any) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _full_from_shards(lt: Logical, shards: list[torch.Tensor]) -> torch.Tensor:
    full = torch.empty(lt.shape, dtype=shards[0].dtype, device=shards[0].device)
    for part in lt.train:
        copy_into(full[_sl(part.box)], part.slot.view(shards[part.shard]))
    return full


def _load_from_full(P: Placements, rank: int, tid: int, full: torch.Tensor,
                    roll: dict[str, torch.Tensor]) -> None:
    # What vLLM's load_weights does with a full tensor: narrow out this rank's part.
    for part in _needs(P, rank).get(tid, []):
        copy_into(part.slot.view(roll[part.slot.name]), full[_sl(part.box)])


class _Peak:
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


def _stage_shard(P: Placements, G: Any, u: Any, my_stage: int, train: dict[str, torch.Tensor],
                 ref: torch.Tensor, peak: "_Peak", st: Any) -> torch.Tensor:
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


def _begin(plan: Plan, rank: int, roll: dict[str, torch.Tensor], method: str):
    """What both reference methods begin with: the placements, this rank's groups, the method's stats, the
    peak counter, the clock, a rollout tensor (its dtype, device and element size) and this rank's pipeline
    stage; the rollout's vocab padding zeroed."""
    P = plan.placements
    G = make_groups(P, rank)
    st = ExecStats(method)
    peak = _Peak()
    t0 = time.perf_counter()
    ref = next(iter(roll.values()))
    my_stage = P.tcoords.pp_rank[rank]
    zero_padding(P, rank, roll)
    return P, G, st, peak, t0, ref, ref.element_size(), my_stage


def execute_upstream(plan: Plan, rank: int, train: dict[str, torch.Tensor],
                     roll: dict[str, torch.Tensor]) -> ExecStats:
    P, G, st, peak, t0, ref, es, my_stage = _begin(plan, rank, roll, "upstream")
    for u in units(P):
        buf = _stage_shard(P, G, u, my_stage, train, ref, peak, st)
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
            full = _full_from_shards(lt, shards)
            peak.add(lt.numel * es)
            _load_from_full(P, rank, tid, full, roll)
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


# --------------------------------------------------------------------------------------
# B: the reference recipe
# --------------------------------------------------------------------------------------


def _expert_exchange(P: Placements, u: Unit, G: Groups, me_idx: int) -> list[list[tuple[int, Any]]]:
    """For expert unit u: sends[k] = [(tid, box)] member me_idx sends to member k (its shard
    cut to what k hosts in rollout), in a fixed order both sides agree on."""
    out: list[list[tuple[int, Any]]] = [[] for _ in G.ep_ranks]
    for tid in u.tids:
        lt = P.tensors[tid]
        mine = [p for p in lt.train if p.shard == me_idx]
        for k, dst in enumerate(G.ep_ranks):
            for rp in _needs(P, dst).get(tid, []):
                for tp_ in mine:
                    inter = intersect(rp.box, tp_.box)
                    if inter is not None:
                        out[k].append((tid, inter))
    return out


def execute_recipe(plan: Plan, rank: int, train: dict[str, torch.Tensor],
                   roll: dict[str, torch.Tensor]) -> Any:
    P, G, st, peak, t0, ref, es, my_stage = _begin(plan, rank, roll, "recipe")
    dt, dev = ref.dtype, ref.device
    p = P.train.pp
    us = units(P)
    # Experts: PP broadcast of the expert-group shard, then AlltoAllV in the expert group.
    me = G.ep_ranks.index(rank)
    for u in (u for u in us if u.kind == "ep"):
        buf = _stage_shard(P, G, u, my_stage, train, ref, peak, st)
        sends = _expert_exchange(P, u, G, me)
        recvs = [_expert_exchange(P, u, G, k)[me] for k in range(len(G.ep_ranks))]
        ssplit = [sum(box_numel(b) for _, b in s) if k != me else 0 for k, s in enumerate(sends)]
        rsplit = [sum(box_numel(b) for _, b in r) if k != me else 0 for k, r in enumerate(recvs)]
        sbuf = torch.empty(sum(ssplit), dtype=dt, device=dev)
        rbuf = torch.empty(sum(rsplit), dtype=dt, device=dev)
        peak.add((sbuf.numel() + rbuf.numel()) * es)

        def part_view(tid: int, box: Any, shard: int) -> torch.Tensor:
            part = next(q for q in P.tensors[tid].train if q.shard == shard)
            rel = tuple(slice(a - pa, b - pa) for (a, b), (pa, _) in zip(box, part.box))
            return part.slot.view(buf)[rel]

        def roll_view(tid: int, box: Any) -> torch.Tensor:
            for rp in _needs(P, rank)[tid]:
                if all(pa <= a and b <= pb for (a, b), (pa, pb) in zip(box, rp.box)):
                    rel = tuple(slice(a - pa, b - pa) for (a, b), (pa, _) in zip(box, rp.box))
                    return rp.slot.view(roll[rp.slot.name])[rel]
            raise KeyError(box)  # pragma: no cover

        off = 0
        for k, lst in enumerate(sends):
            for tid, box in lst:
                if k == me:
                    copy_into(roll_view(tid, box), part_view(tid, box, me))
                    continue
                n = box_numel(box)
                copy_into(sbuf[off:off + n].view([b - a for a, b in box]), part_view(tid, box, me))
                off += n
        dist.all_to_all_single(rbuf, sbuf, output_split_sizes=rsplit, input_split_sizes=ssplit, group=G.ep)
        st.collectives += 1
        st.recv_bytes += rbuf.numel() * es
        off = 0
        for k, lst in enumerate(recvs):
            if k == me:
                continue
            for tid, box in lst:
                n = box_numel(box)
                copy_into(roll_view(tid, box), rbuf[off:off + n].view([b - a for a, b in box]))
                off += n
        peak.sub((sbuf.numel() + rbuf.numel()) * es)
        if my_stage != u.stage:
            peak.sub(u.shard_numel * es)
        del sbuf, rbuf, buf
    # Dense: round j = the j-th dense unit of every stage; TP all-gather, then PP all-to-all.
    dense = [[u for u in us if u.kind != "ep" and u.stage == s] for s in range(p)]
    for j in range(max(len(d) for d in dense)):
        fulls: dict[int, torch.Tensor] = {}
        mine = dense[my_stage][j] if j < len(dense[my_stage]) else None
        if mine is not None:
            buf = train[mine.name]
            if mine.kind == "tp" and len(G.tp_ranks) > 1:
                shards = [torch.empty_like(buf) for _ in G.tp_ranks]
                peak.add(len(shards) * mine.shard_numel * es)
                dist.all_gather(shards, buf, group=G.tp)
                st.collectives += 1
                st.recv_bytes += (len(shards) - 1) * mine.shard_numel * es
            else:
                shards = [buf] * max(1, len(G.tp_ranks))
            for tid in mine.tids:
                fulls[tid] = _full_from_shards(P.tensors[tid], shards)
                peak.add(P.tensors[tid].numel * es)
            if mine.kind == "tp" and len(G.tp_ranks) > 1:
                peak.sub(len(shards) * mine.shard_numel * es)
            del shards
        if p > 1:
            sizes = [sum(P.tensors[i].numel for i in dense[s][j].tids) if j < len(dense[s]) else 0
                     for s in range(p)]
            flat = (torch.cat([fulls[i].reshape(-1) for i in mine.tids]) if mine is not None
                    else torch.empty(0, dtype=dt, device=dev))
            ssplit = [sizes[my_stage] if s != my_stage else 0 for s in range(p)]
            rsplit = [sizes[s] if s != my_stage else 0 for s in range(p)]
            sbuf = flat.repeat(p - 1) if flat.numel() else flat
            rbuf = torch.empty(sum(rsplit), dtype=dt, device=dev)
            peak.add((flat.numel() + sbuf.numel() + rbuf.numel()) * es)
            dist.all_to_all_single(rbuf, sbuf, output_split_sizes=rsplit, input_split_sizes=ssplit,
                                   group=G.pp)
            st.collectives += 1
            st.recv_bytes += rbuf.numel() * es
            off = 0
            for s in range(p):
                if s == my_stage or j >= len(dense[s]):
                    continue
                for tid in dense[s][j].tids:
                    n = P.tensors[tid].numel
                    fulls[tid] = rbuf[off:off + n].view(P.tensors[tid].shape)
                    off += n
            peak.sub((flat.numel() + sbuf.numel()) * es)
            del flat, sbuf
        for tid, full in fulls.items():
            _load_from_full(P, rank, tid, full, roll)
        if mine is not None:
            peak.sub(sum(P.tensors[i].numel for i in mine.tids) * es)
        if p > 1:
            peak.sub(rbuf.numel() * es)
        fulls.clear()
    accelerator.synchronize()
    st.seconds = time.perf_counter() - t0
    st.peak_extra_bytes = peak.peak
    return st


def recipe_stats(P: Placements, elem_size: int) -> list[RankStats]:
    """Bytes, collectives and transient memory of B per rank, from metadata alone (mirrors
    execute_recipe; tests compare the two)."""
    W, tc = P.world, P.tcoords
    t, p = P.train.tp, P.train.pp
    out = [RankStats() for _ in range(W)]
    us = units(P)
    ex = [u for u in us if u.kind == "ep"]
    dense = [[u for u in us if u.kind != "ep" and u.stage == s] for s in range(p)]
    group_of = {x: g for g in tc.expert_groups for x in g}
    # Expert AlltoAllV: what each rank receives from / sends to the rest of its expert group.
    # Expert parts differ only in the expert range (dim 0): interval arithmetic.
    a2a_recv = [[0] * len(ex) for _ in range(W)]
    a2a_send = [[0] * len(ex) for _ in range(W)]
    for ui, u in enumerate(ex):
        for tid in u.tids:
            lt = P.tensors[tid]
            inner = lt.numel // lt.shape[0]
            held = [(q.box[0], q.shard) for q in lt.train]
            for rp in lt.rollout:
                a, b = rp.box[0]
                for (qa, qb), k in held:
                    n = (min(b, qb) - max(a, qa)) * inner
                    if n <= 0:
                        continue
                    for r in rp.ranks:
                        if tc.expert_rank[r] == k:
                            continue  # already holds it after the broadcast: local copy
                        a2a_recv[r][ui] += n
                        a2a_send[group_of[r][k]][ui] += n
    for r in range(W):
        s_r = tc.pp_rank[r]
        recv = coll = pk = 0
        for ui, u in enumerate(ex):
            bc = u.shard_numel if s_r != u.stage else 0
            if p > 1:
                coll += 1
                recv += bc
            coll += 1
            recv += a2a_recv[r][ui]
            pk = max(pk, bc + a2a_recv[r][ui] + a2a_send[r][ui])
        for j in range(max(len(d) for d in dense)):
            mine = dense[s_r][j] if j < len(dense[s_r]) else None
            sizes = [sum(P.tensors[i].numel for i in dense[s][j].tids) if j < len(dense[s]) else 0
                     for s in range(p)]
            g_pk = 0
            if mine is not None and mine.kind == "tp" and t > 1:
                coll += 1
                recv += (t - 1) * mine.shard_numel
                g_pk = t * mine.shard_numel
            pk = max(pk, g_pk + sizes[s_r])
            if p > 1:
                coll += 1
                recv += sum(sizes) - sizes[s_r]
                # own full tensors + their flat copy + p-1 send copies + the receive buffer
                pk = max(pk, sizes[s_r] * (1 + p) + sum(sizes) - sizes[s_r])
        out[r].recv_bytes = recv * elem_size
        out[r].collectives = coll
        out[r].peak_extra_bytes = pk * elem_size
    return out


def plan_summaries(plan: Plan) -> list[dict[str, Any]]:
    """One dict per method with max/mean received bytes per rank, total bytes on links,
    collectives per rank and peak extra device memory per rank."""
    P, es = plan.placements, plan.elem_size
    return [summarize("direct", plan.ranks), summarize("upstream", upstream_stats(P, es)),
            summarize("recipe", recipe_stats(P, es))]
