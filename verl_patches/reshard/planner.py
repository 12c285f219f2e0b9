"""Direct slice routing planner: for every rollout rank and logical tensor, which training rank
sends which box, grouped into size-bounded all-to-all buckets (pure metadata, no tensors).

Every destination element is received exactly once; a rank that already holds a box copies it
locally; among replicas the sender with the fewest bytes so far is chosen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from verl_patches.config.settings import BUCKET_BYTES
from verl_patches.reshard.box import Box, box_numel, intersect, split_box
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import LayoutError, ModelConfig
from verl_patches.reshard.placements import build_placements, Placements

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

class Transfer(NamedTuple):
    """One box of one tensor moving from a training holder to a rollout holder (src == dst: a
    local copy)."""

    tensor: int  # index into Placements.tensors
    box: Box
    src: int
    dst: int
    numel: int


@dataclass
class RankStats:
    sent_bytes: int = 0
    recv_bytes: int = 0
    local_bytes: int = 0
    shard_bytes: int = 0  # this rank's rollout shard (real elements, vocab padding excluded)
    peak_extra_bytes: int = 0
    collectives: int = 0


@dataclass
class Plan:
    placements: Placements
    dtype: str
    elem_size: int
    bucket_bytes: int
    local: list[Transfer]
    buckets: list[list[Transfer]]
    ranks: list[RankStats] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.placements.world

    def summary(self) -> dict[str, Any]:
        return summarize("direct", self.ranks)


def summarize(method: str, ranks: list[RankStats]) -> dict[str, Any]:
    recv = [s.recv_bytes for s in ranks]
    return {
        "method": method,
        "max_recv_bytes": max(recv),
        "mean_recv_bytes": sum(recv) / len(recv),
        "total_link_bytes": sum(recv),
        "collectives": max(s.collectives for s in ranks),
        "peak_extra_bytes": max(s.peak_extra_bytes for s in ranks),
    }


def as_model(model: ModelConfig | dict | str) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, dict):
        return ModelConfig.from_hf(model)
    with open(model) as f:
        return ModelConfig.from_hf(json.load(f))


def build_plan(model: ModelConfig | dict | str, train: TrainLayout | str, rollout: RolloutLayout | str,
               bucket_bytes: int = BUCKET_BYTES, dtype: str = "bfloat16",
               placements: Placements | None = None) -> Plan:
    """Route every rollout element from one training holder; bucket by bucket_bytes per rank
    (each rank's send plus receive volume in one bucket stays within it)."""
    if dtype not in DTYPE_BYTES:
        raise LayoutError(f"dtype {dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
    if isinstance(train, str):
        train = TrainLayout.parse(train)
    if isinstance(rollout, str):
        rollout = RolloutLayout.parse(rollout)
    P = placements or build_placements(as_model(model), train, rollout)
    es = DTYPE_BYTES[dtype]
    cap = bucket_bytes // es
    if cap < 1:
        raise LayoutError(f"bucket of {bucket_bytes} bytes holds no {dtype} element")
    W = P.world
    stats = [RankStats() for _ in range(W)]
    sent = [0] * W
    local: list[Transfer] = []
    pair_q: dict[tuple[int, int], list[Transfer]] = {}
    for tid, lt in enumerate(P.tensors):
        holders = [(q.box, q.ranks, frozenset(q.ranks)) for q in lt.train]
        for part in lt.rollout:
            covered = 0
            pieces = []
            for qbox, qranks, qset in holders:
                inter = intersect(part.box, qbox)
                if inter is not None:
                    pieces.append((inter, qranks, qset))
                    covered += box_numel(inter)
            need = box_numel(part.box)
            if covered != need:
                raise LayoutError(f"{lt.name}: rollout part {part.box} has {need} elements but the "
                                  f"training parts cover {covered}")
            for dst in part.ranks:
                stats[dst].shard_bytes += need * es
                for inter, qranks, qset in pieces:
                    n = box_numel(inter)
                    if dst in qset:
                        local.append(Transfer(tid, inter, dst, dst, n))
                        stats[dst].local_bytes += n * es
                        continue
                    src = min(qranks, key=sent.__getitem__)
                    sent[src] += n
                    # pieces of at most a quarter bucket, so a bucket can carry traffic in both
                    # directions of a link at once (links are full duplex)
                    for sub in split_box(inter, max(1, cap // 4)):
                        pair_q.setdefault((src, dst), []).append(Transfer(tid, sub, src, dst, box_numel(sub)))
    # Round-robin over (src, dst) pairs: every bucket then mixes all pairs and directions
    # instead of, say, stage 0 sending in the first buckets and stage 1 in the last ones.
    remote: list[Transfer] = []
    queues = list(pair_q.values())
    depth = 0
    while queues:
        remote.extend(q[depth] for q in queues)
        depth += 1
        queues = [q for q in queues if len(q) > depth]
    # First fit into buckets. The bound is on a rank's send + receive volume in one bucket (its
    # two buffers); the executor keeps two buckets in flight, so its extra memory stays within
    # two buckets. A rank's pointer is its first bucket with room left (full once less than
    # 1/16 is free), so later small transfers backfill earlier buckets and the number of
    # collectives stays near (send + recv) / cap.
    bsend: list[list[int]] = []
    brecv: list[list[int]] = []
    used: list[list[int]] = []
    buckets: list[list[Transfer]] = []
    ptr = [0] * W
    full = cap - max(1, cap // 16)
    for tr in remote:
        src, dst, n = tr.src, tr.dst, tr.numel
        b = max(ptr[src], ptr[dst])
        while True:
            if b == len(buckets):
                buckets.append([])
                bsend.append([0] * W)
                brecv.append([0] * W)
                used.append([0] * W)
            if used[b][src] + n <= cap and used[b][dst] + n <= cap:
                break
            b += 1
        buckets[b].append(tr)
        bsend[b][src] += n
        brecv[b][dst] += n
        used[b][src] += n
        used[b][dst] += n
        for r in (src, dst):
            while ptr[r] < len(buckets) and used[ptr[r]][r] >= full:
                ptr[r] += 1
    for r in range(W):
        st = stats[r]
        st.sent_bytes = sum(bs[r] for bs in bsend) * es
        st.recv_bytes = sum(br[r] for br in brecv) * es
        st.peak_extra_bytes = pipeline_peak([u[r] for u in used]) * es
        st.collectives = len(buckets)
    return Plan(P, dtype, es, bucket_bytes, local, buckets, stats)


def pipeline_peak(per_bucket: list[int]) -> int:
    """Extra memory of the executor: two staging buffers (one while a single bucket), each
    sized for this rank's largest bucket (send + receive)."""
    return max(per_bucket, default=0) * min(2, len(per_bucket))


@dataclass
class RankProgram:
    """What one rank does: local copies, then per bucket its pack list (per destination peer,
    in plan order) and unpack list (per source peer, in plan order) with split sizes."""

    local: list[Transfer]
    buckets: list[tuple[list[int], list[int], list[Transfer], list[Transfer]]]


def rank_program(plan: Plan, rank: int) -> RankProgram:
    W = plan.world
    local = [t for t in plan.local if t.dst == rank]
    out = []
    for bucket in plan.buckets:
        send = sorted((t for t in bucket if t.src == rank), key=lambda t: t.dst)  # stable: plan order
        recv = sorted((t for t in bucket if t.dst == rank), key=lambda t: t.src)
        ssplit = [0] * W
        rsplit = [0] * W
        for t in send:
            ssplit[t.dst] += t.numel
        for t in recv:
            rsplit[t.src] += t.numel
        out.append((ssplit, rsplit, send, recv))
    return RankProgram(local, out)
