"""The rollout's long-tail rebalance POLICY: which captured graph size each DP rank needs, and which
unfinished requests to move between DP ranks so that the whole DP group can drop to a smaller graph size.

Pure functions, no vLLM: the mechanism that moves requests (verl_patches/rollout/long_tail/migrate.py, run by the
CPU generation stand-in; not inside vLLM's engine on a device yet) and ``python -m verl_patches
rollout-plan`` (verl_patches/rollout/long_tail/simulator.py) both run this same code. docs/ROLLOUT.md explains the
tail, the policy and the mechanism.

Why the group, not a rank: the DP ranks of one vLLM instance step in lockstep (MoE all-to-all), and
every rank pads its decode batch to the captured graph of the group's largest batch. The group's
step therefore costs the graph size of its fullest rank.

The plan, for the unfinished request ids per rank ``counts[r]``, graph sizes ``b_1 < ... < b_k`` and a
per-rank capacity ``cap[r]`` (max_num_seqs, or less where a rank's KV cache is short):

- target graph size: the smallest ``b`` with ``sum_r min(b, cap[r]) >= total`` (no plan of any kind can
  put ``total`` requests on the ranks with fewer than ``min(b, cap[r])`` each otherwise, so no smaller
  graph size is reachable);
- moves: each rank above ``room[r] = min(b, cap[r])`` sends exactly ``counts[r] - room[r]`` requests,
  to ranks below their room. That is the fewest moves: a move lowers one rank's count by one, so a rank
  with ``counts[r] > room[r]`` must send at least the excess, and the sum of excesses is a lower bound;
  the plan meets it because the free room ``sum_r max(0, room[r] - counts[r])`` is at least the excess
  exactly when ``sum_r room[r] >= total`` (the reachability condition). No request moves twice and no
  rank both sends and receives.

Ties are broken deterministically: the requests a rank sends are its cheapest (``weights``, e.g. the
tokens whose KV would move, default 0), then the smallest request ids; they go out in rank order, each
to the rank with the most free room (then the lowest rank), which keeps the group balanced for the next
drop. ``restore`` puts every output back on its original rank in its original order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from verl_patches.config import settings


class RebalanceError(ValueError):
    """Malformed input to the rebalance policy; the message names the problem."""


@dataclass(frozen=True)
class Move:
    request: Hashable
    src: int
    dst: int


@dataclass(frozen=True)
class RebalancePolicy:
    """When to rebalance (recipe.rebalance*, verl_patches/config/settings.py). A plan is taken only when it
    lowers the group's graph size at all, and then when it lowers it by at least ``min_graph_size_drop``
    graph sizes of the captured list, or when the fullest rank holds more than ``max_imbalance`` times
    the mean (None: only the drop counts)."""

    enabled: bool = settings.KEYS["rebalance"].default
    min_graph_size_drop: int = settings.KEYS["rebalance_min_graph_size_drop"].default
    max_imbalance: float | None = settings.KEYS["rebalance_max_imbalance"].default

    def __post_init__(self) -> None:
        # The keys' own rules (verl_patches/config/settings.py), for a policy built from anything else (the planner).
        for key, value in (("rebalance", self.enabled), ("rebalance_min_graph_size_drop", self.min_graph_size_drop),
                           ("rebalance_max_imbalance", self.max_imbalance)):
            problem = settings.problem(key, value, key)
            if problem:
                raise RebalanceError(problem)

    @classmethod
    def from_settings(cls, recipe: Any) -> "RebalancePolicy":
        """From the run's RecipeSettings (verl_patches/config/settings.py)."""
        return cls(enabled=recipe.rebalance, min_graph_size_drop=recipe.rebalance_min_graph_size_drop,
                   max_imbalance=recipe.rebalance_max_imbalance)

    @classmethod
    def from_recipe(cls, section: Any) -> "RebalancePolicy":
        """From the recipe section (a DictConfig, a mapping or None), read as the run's RecipeSettings."""
        try:
            return cls.from_settings(settings.build(section))
        except settings.SettingsError as e:
            raise RebalanceError(str(e)) from None


@dataclass(frozen=True)
class Decision:
    needed: dict[int, int]  # rank -> the graph size its unfinished requests need now
    current_graph_size: int  # the group's graph size now (the largest needed)
    target_graph_size: int  # the smallest reachable graph size
    moves: tuple[Move, ...]  # the plan to reach it (empty when it is the current one)
    imbalance: float  # fullest rank / mean (1.0: even; 0 requests: 1.0)
    rebalance: bool  # the policy takes the plan
    reason: str

    @property
    def graph_size_after(self) -> int:
        return self.target_graph_size if self.rebalance else self.current_graph_size


# ---------- input checks ----------

def check_graph_sizes(graph_sizes: Sequence[int]) -> tuple[int, ...]:
    """The captured graph batch sizes, strictly increasing positive integers."""
    if isinstance(graph_sizes, (str, bytes)) or not isinstance(graph_sizes, Sequence) or not graph_sizes:
        raise RebalanceError(f"graph batch sizes must be a non-empty sorted list of positive integers, got {graph_sizes!r}")
    for b in graph_sizes:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise RebalanceError(f"graph batch size {b!r} is not a positive integer (in {list(graph_sizes)})")
    if any(a >= b for a, b in zip(graph_sizes, graph_sizes[1:])):
        raise RebalanceError(f"graph batch sizes must be strictly increasing, got {list(graph_sizes)}")
    return tuple(graph_sizes)


def _check_layout(layout: Mapping[int, Sequence[Hashable]]) -> dict[int, list]:
    if not isinstance(layout, Mapping) or not layout:
        raise RebalanceError(f"the unfinished requests must be a non-empty mapping rank -> request ids, got {layout!r}")
    out: dict[int, list] = {}
    seen: dict[Hashable, int] = {}
    kinds: set[type] = set()
    for rank, ids in layout.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise RebalanceError(f"DP rank {rank!r} is not a non-negative integer")
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise RebalanceError(f"rank {rank}: request ids must be a list, got {ids!r}")
        for rid in ids:
            if isinstance(rid, bool) or not isinstance(rid, (int, str)):
                raise RebalanceError(f"rank {rank}: request id {rid!r} is not an int or a str")
            kinds.add(type(rid))
            if rid in seen:
                raise RebalanceError(f"request id {rid!r} is on rank {seen[rid]} and rank {rank}")
            seen[rid] = rank
        out[rank] = list(ids)
    if len(kinds) > 1:
        raise RebalanceError("request ids mix ints and strs; use one kind so ties break in one order")
    return {r: out[r] for r in sorted(out)}


def _capacities(ranks: Iterable[int], capacity: int | Mapping[int, int] | None, top: int) -> dict[int, int]:
    caps: dict[int, int] = {}
    for r in ranks:
        c = top if capacity is None else capacity if not isinstance(capacity, Mapping) else capacity.get(r, top)
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise RebalanceError(f"rank {r}: capacity {c!r} is not a non-negative integer")
        caps[r] = min(c, top)
    return caps


# ---------- (a) the graph size each rank needs ----------

def graph_size_for(count: int, graph_sizes: Sequence[int]) -> int:
    """The smallest graph size >= count (a rank with no request runs the smallest: the group still steps)."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise RebalanceError(f"a request count must be a non-negative integer, got {count!r}")
    for b in graph_sizes:
        if b >= count:
            return b
    raise RebalanceError(f"{count} unfinished requests exceed the largest graph batch size {graph_sizes[-1]} "
                         f"(graph_batch_sizes {list(graph_sizes)}; max_num_seqs must not exceed it)")


def needed_graph_sizes(layout: Mapping[int, Sequence[Hashable]], graph_sizes: Sequence[int]) -> dict[int, int]:
    """rank -> the graph size its unfinished requests need."""
    graph_sizes = check_graph_sizes(graph_sizes)
    return {r: graph_size_for(len(ids), graph_sizes) for r, ids in _check_layout(layout).items()}


# ---------- (b) the move plan ----------

def target_graph_size(counts: Mapping[int, int], graph_sizes: Sequence[int],
                  capacity: int | Mapping[int, int] | None = None) -> int:
    """The smallest graph size b with sum_r min(b, cap[r]) >= total: the smallest any plan can reach."""
    graph_sizes = check_graph_sizes(graph_sizes)
    total = sum(counts.values())
    if capacity is None or not isinstance(capacity, Mapping):  # one capacity for all: no per-rank sum
        cap = _capacities((0,), capacity, graph_sizes[-1])[0]
        fits = [b for b in graph_sizes if len(counts) * min(b, cap) >= total]
    else:
        caps = _capacities(counts, capacity, graph_sizes[-1])
        fits = [b for b in graph_sizes if sum(min(b, c) for c in caps.values()) >= total]
    if not fits:
        raise RebalanceError(f"{total} unfinished requests do not fit {len(counts)} DP ranks at the largest graph "
                             f"batch size {graph_sizes[-1]} within the ranks' capacities")
    return fits[0]


def plan_moves(layout: Mapping[int, Sequence[Hashable]], graph_sizes: Sequence[int],
               capacity: int | Mapping[int, int] | None = None,
               weights: Mapping[Hashable, float] | None = None) -> tuple[int, tuple[Move, ...]]:
    """(the smallest reachable graph size, the fewest moves that reach it); see the module docstring."""
    graph_sizes = check_graph_sizes(graph_sizes)
    layout = _check_layout(layout)
    caps = _capacities(layout, capacity, graph_sizes[-1])
    for r, ids in layout.items():
        graph_size_for(len(ids), graph_sizes)  # a count beyond the largest graph size is malformed
        if len(ids) > caps[r]:
            raise RebalanceError(f"rank {r} holds {len(ids)} requests, more than its capacity {caps[r]}")
    weights = weights or {}
    counts = {r: len(ids) for r, ids in layout.items()}
    b = target_graph_size(counts, graph_sizes, caps)
    room = {r: min(b, caps[r]) for r in layout}
    # Receivers: most free room first, then the lowest rank (a heap of (-free, rank)).
    free = [(-(room[r] - counts[r]), r) for r in layout if room[r] > counts[r]]
    heapq.heapify(free)
    moves: list[Move] = []
    for r, ids in layout.items():
        excess = counts[r] - room[r]
        if excess <= 0:
            continue

        def key(rid: Hashable) -> tuple:
            w = weights.get(rid, 0)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w != w:
                raise RebalanceError(f"request {rid!r}: weight {w!r} is not a number")
            return (w, rid)

        for rid in sorted(ids, key=key)[:excess]:
            neg, dst = heapq.heappop(free)  # never empty: the free room covers the excess
            moves.append(Move(rid, r, dst))
            if neg + 1 < 0:
                heapq.heappush(free, (neg + 1, dst))
    return b, tuple(moves)


def imbalance(counts: Mapping[int, int]) -> float:
    """The fullest rank's count over the mean (1.0 when even or empty)."""
    total = sum(counts.values())
    return 1.0 if total == 0 else max(counts.values()) * len(counts) / total


@dataclass(frozen=True)
class Verdict:
    current_graph_size: int
    target_graph_size: int
    imbalance: float
    rebalance: bool
    reason: str


def judge(counts: Mapping[int, int], graph_sizes: Sequence[int], policy: RebalancePolicy,
          capacity: int | Mapping[int, int] | None = None) -> Verdict:
    """Whether ``policy`` rebalances the unfinished request counts per rank (counts only: cheap enough
    for every step of a scheduler; ``decide`` adds the plan)."""
    graph_sizes = check_graph_sizes(graph_sizes)
    if not isinstance(counts, Mapping) or not counts:
        raise RebalanceError(f"the request counts must be a non-empty mapping rank -> count, got {counts!r}")
    for r, c in counts.items():
        if type(c) is not int or c < 0:  # noqa: E721 - exactly int (not bool), and fast on every step
            raise RebalanceError(f"rank {r!r}: a request count must be a non-negative integer, got {c!r}")
    current = graph_size_for(max(counts.values()), graph_sizes)
    target = target_graph_size(counts, graph_sizes, capacity)
    imb = imbalance(counts)
    drop = graph_sizes.index(current) - graph_sizes.index(target)
    if not policy.enabled:
        take, why = False, "rebalance is off"
    elif drop <= 0:
        take, why = False, f"graph size {current} is already the smallest reachable"
    elif drop >= policy.min_graph_size_drop:
        take, why = True, f"graph size {current} -> {target} ({drop} step(s) >= {policy.min_graph_size_drop})"
    elif policy.max_imbalance is not None and imb > policy.max_imbalance:
        take, why = True, f"graph size {current} -> {target}: imbalance {imb:.2f} > {policy.max_imbalance}"
    else:
        take, why = False, (f"graph size {current} -> {target} is {drop} step(s) < {policy.min_graph_size_drop}"
                            + (f" and imbalance {imb:.2f} <= {policy.max_imbalance}"
                               if policy.max_imbalance is not None else ""))
    return Verdict(current, target, imb, take, why)


def decide(layout: Mapping[int, Sequence[Hashable]], graph_sizes: Sequence[int], policy: RebalancePolicy,
           capacity: int | Mapping[int, int] | None = None,
           weights: Mapping[Hashable, float] | None = None) -> Decision:
    """The graph sizes needed now, the best reachable plan, and whether ``policy`` takes it."""
    graph_sizes = check_graph_sizes(graph_sizes)
    needed = needed_graph_sizes(layout, graph_sizes)
    target, moves = plan_moves(layout, graph_sizes, capacity, weights)
    v = judge({r: len(ids) for r, ids in _check_layout(layout).items()}, graph_sizes, policy, capacity)
    assert v.target_graph_size == target and v.current_graph_size == max(needed.values())
    return Decision(needed, v.current_graph_size, target, moves if v.rebalance else (), v.imbalance, v.rebalance, v.reason)


# ---------- applying a plan and restoring the outputs ----------

def apply_moves(layout: Mapping[int, Sequence[Hashable]], moves: Iterable[Move]) -> dict[int, list]:
    """The layout after ``moves`` (each request appended to its destination, in plan order)."""
    out = {r: list(ids) for r, ids in _check_layout(layout).items()}
    for m in moves:
        if m.src not in out or m.dst not in out:
            raise RebalanceError(f"move of {m.request!r}: rank {m.src if m.src not in out else m.dst} is not in the layout")
        if m.request not in out[m.src]:
            raise RebalanceError(f"move of {m.request!r} from rank {m.src}: the request is not there")
        out[m.src].remove(m.request)
        out[m.dst].append(m.request)
    return out


def origins(layout: Mapping[int, Sequence[Hashable]]) -> dict[Hashable, tuple[int, int]]:
    """request id -> (its original rank, its index there): the restore map, from the layout before
    any move (requests may move several times; only where they started matters)."""
    return {rid: (r, i) for r, ids in _check_layout(layout).items() for i, rid in enumerate(ids)}


def restore(original: Mapping[int, Sequence[Hashable]],
            outputs: Mapping[int, Iterable[tuple[Hashable, Any]]]) -> dict[int, list]:
    """Every output back on its original rank in its original order. ``outputs``: rank -> (request
    id, output) pairs wherever the requests finished. Each original request must come back exactly once."""
    where = origins(original)
    back: dict[int, list] = {r: [None] * len(ids) for r, ids in _check_layout(original).items()}
    got: dict[Hashable, int] = {}
    for rank, pairs in outputs.items():
        for rid, out in pairs:
            if rid not in where:
                raise RebalanceError(f"rank {rank} returned request {rid!r}, which no rank started with")
            if rid in got:
                raise RebalanceError(f"request {rid!r} came back twice (ranks {got[rid]} and {rank})")
            got[rid] = rank
            r, i = where[rid]
            back[r][i] = out
    missing = [rid for rid in where if rid not in got]
    if missing:
        raise RebalanceError(f"{len(missing)} request(s) did not come back, e.g. {missing[:3]}")
    return back
