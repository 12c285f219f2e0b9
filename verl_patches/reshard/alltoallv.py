"""The reference recipe's weight update (method ``alltoallv``), run on the same placements and tensors as the
direct plan, for comparison: experts by a PP broadcast of the expert-group shards and one AlltoAllV inside the
expert group (each rank receives only the experts it hosts); dense tensors by a TP all-gather in the owner stage
and one PP all-to-all that spreads the gathered full tensors to every stage. ``alltoallv_stats`` costs it from
the metadata alone.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from verl_patches.base import accelerator
from verl_patches.reshard.baselines import Groups, Unit, begin, full_from_shards, load_from_full, needs, stage_shard, units
from verl_patches.reshard.box import box_numel, intersect
from verl_patches.reshard.copyops import copy_into
from verl_patches.reshard.placements import Placements
from verl_patches.reshard.planner import Plan, RankStats




def _expert_exchange(P: Placements, u: Unit, G: Groups, me_idx: int) -> list[list[tuple[int, Any]]]:
    """For expert unit u: sends[k] = [(tid, box)] member me_idx sends to member k (its shard
    cut to what k hosts in rollout), in a fixed order both sides agree on."""
    out: list[list[tuple[int, Any]]] = [[] for _ in G.ep_ranks]
    for tid in u.tids:
        lt = P.tensors[tid]
        mine = [p for p in lt.train if p.shard == me_idx]
        for k, dst in enumerate(G.ep_ranks):
            for rp in needs(P, dst).get(tid, []):
                for tp_ in mine:
                    inter = intersect(rp.box, tp_.box)
                    if inter is not None:
                        out[k].append((tid, inter))
    return out


def execute_alltoallv(plan: Plan, rank: int, train: dict[str, torch.Tensor],
                   roll: dict[str, torch.Tensor]) -> Any:
    P, G, st, peak, t0, ref, es, my_stage = begin(plan, rank, roll, "alltoallv")
    dt, dev = ref.dtype, ref.device
    p = P.train.pp
    us = units(P)
    # Experts: PP broadcast of the expert-group shard, then AlltoAllV in the expert group.
    me = G.ep_ranks.index(rank)
    for u in (u for u in us if u.kind == "ep"):
        buf = stage_shard(P, G, u, my_stage, train, ref, peak, st)
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
            for rp in needs(P, rank)[tid]:
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
                fulls[tid] = full_from_shards(P.tensors[tid], shards)
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
            load_from_full(P, rank, tid, full, roll)
        if mine is not None:
            peak.sub(sum(P.tensors[i].numel for i in mine.tids) * es)
        if p > 1:
            peak.sub(rbuf.numel() * es)
        fulls.clear()
    accelerator.synchronize()
    st.seconds = time.perf_counter() - t0
    st.peak_extra_bytes = peak.peak
    return st


def alltoallv_stats(P: Placements, elem_size: int) -> list[RankStats]:
    """Bytes, collectives and transient memory of B per rank, from metadata alone (mirrors
    execute_alltoallv; tests compare the two)."""
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
