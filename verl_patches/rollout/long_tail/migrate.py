"""The rollout's long-tail rebalance MECHANISM: move unfinished requests between the DP ranks of one
rollout while they generate, and put every output back on its original rank, in its original order.

The policy (which requests, from where to where) is verl_patches/rollout/long_tail/rebalance.py, imported: the
same code the planner runs. This module is the lockstep around it, device-agnostic and engine-agnostic:

- ``Lockstep``: at every check (every decode step of the DP group), the ranks all-gather their
  counts of running and waiting requests on the DP group (one small collective), and every rank runs
  ``rebalance.judge`` on the same counts; only when it says rebalance do they all-gather the running
  request ids with their weights (the tokens whose state would move) and all compute the same
  ``rebalance.decide`` plan. No coordinator: identical inputs give identical plans.
- ``transfer`` (verl_patches/rollout/long_tail/kv_transfer.py): the moved requests' states go point to point
  per (source, destination) pair, every isend / irecv posted before any wait, so no order deadlocks.
  A state is the engine's own dict (``RequestState``'s ``pack`` in the CPU stand-in, ``vllm_move``'s
  payload): prompt ids, generated ids, log-probs so far, the request's sampling generator state and
  its KV cache. The KV entry's tensors travel as one buffer per pair (per dtype) over the lockstep's
  ``kv_group``, device to device on NCCL / HCCL (the DP group itself, gloo, when none is given); the
  rest is pickled over the DP group, on the host.
- ``Lockstep.restore``: every finished output goes back to its original rank (the same point to point
  transfer) and ``rebalance.restore`` orders it there, failing on a lost or duplicated request.

Exactness is the engine's part: a moved request must compute on its new rank exactly what it would
have computed at home. That needs its own sampling generator (vLLM's per-request seed, or one drawn
per request from the rank's stream in original order) and a forward whose result for one request
does not depend on the other requests of the batch (checked for the CPU stand-in in
tests/rollout/long_tail/test_migrate.py). docs/ROLLOUT.md states the costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verl_patches.rollout.long_tail import kv_transfer
from verl_patches.rollout.long_tail import rebalance as rb


class MigrateError(kv_transfer.TransferError):
    """The DP ranks disagree or a transfer is malformed; the message names the problem."""


def transfer(moves: Sequence[rb.Move], payloads: Mapping[Any, Any], group: Any,
             kv_group: Any = None) -> tuple[dict, int]:
    """``kv_transfer.transfer`` (see there), its errors raised as ``MigrateError``."""
    try:
        return kv_transfer.transfer(moves, payloads, group, kv_group)
    except MigrateError:
        raise
    except kv_transfer.TransferError as e:
        raise MigrateError(str(e)) from e


@dataclass(frozen=True)
class RebalanceSetup:
    """What the generation runs the mechanism with (the CPU stand-in builds it from the rollout settings,
    recipe.rebalance*: verl_patches/rigs/cpu/engine.py:rebalance_setup): the policy, and the CPU stand-in's
    test-only stagger (DP rank r admits its requests r x ``stagger`` decode steps late, forcing an
    uneven tail; 0: off)."""

    policy: rb.RebalancePolicy
    stagger: int = 0


@dataclass
class LockstepStats:
    checks: int = 0  # lockstep checks (one per decode step of the group)
    rebalances: int = 0  # checks whose plan the policy took
    moves: int = 0  # requests moved, over the whole DP group
    sent_bytes: int = 0  # state bytes this rank sent (moves and the outputs' return)
    returned: int = 0  # outputs this rank sent back to their original rank

    def figures(self, prefix: str = "rollout/") -> dict[str, float]:
        return {f"{prefix}rebalance_checks": float(self.checks), f"{prefix}rebalances": float(self.rebalances),
                f"{prefix}rebalance_moves": float(self.moves), f"{prefix}rebalance_sent_bytes": float(self.sent_bytes)}


@dataclass
class Lockstep:
    """One rollout's lockstep over the DP ``group`` (every rank of the group calls every method, in
    the same order). ``graph_sizes``: the captured graph batch sizes; ``capacity``: max_num_seqs per rank;
    ``kv_group``: the process group the moved KV rows go over, device to device (NCCL / HCCL: the same
    ranks as ``group``; None: ``group`` itself, gloo, with the rows on the host)."""

    group: Any
    policy: rb.RebalancePolicy
    graph_sizes: tuple[int, ...]
    capacity: int
    kv_group: Any = None
    stats: LockstepStats = field(default_factory=LockstepStats)
    original: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.graph_sizes = rb.check_graph_sizes(list(self.graph_sizes))
        if self.capacity > self.graph_sizes[-1]:
            raise MigrateError(f"max_num_seqs {self.capacity} exceeds the largest graph batch size {self.graph_sizes[-1]}")
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        if self.kv_group is not None:
            kv_transfer.prepare(self.kv_group)  # a collective: every rank builds its Lockstep together

    def begin(self, local: int) -> list[int]:
        """Global request ids of this rank's ``local`` requests (unique over the group, in rank then
        original order), and the layout ``restore`` returns to."""
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(counts, torch.tensor([local], dtype=torch.int64), group=self.group)
        start = 0
        for r, c in enumerate(counts):
            self.original[r] = list(range(start, start + int(c.item())))
            start += int(c.item())
        return self.original[self.rank]

    def check(self, running: Mapping[int, int], waiting: int) -> tuple[bool, tuple[rb.Move, ...]]:
        """(whether any rank of the group still has work, the moves to make now). ``running``:
        request id -> its weight (tokens whose state would move) for this rank's running requests."""
        mine = torch.tensor([len(running), int(waiting)], dtype=torch.int64)
        every = [torch.zeros(2, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        self.stats.checks += 1
        if sum(int(t.sum()) for t in every) == 0:
            return False, ()
        counts = {r: int(t[0]) for r, t in enumerate(every)}
        if not rb.judge(counts, self.graph_sizes, self.policy, self.capacity).rebalance:
            return True, ()
        lists: list[Any] = [None] * self.size
        dist.all_gather_object(lists, sorted(running.items()), group=self.group)
        layout = {r: [rid for rid, _ in items] for r, items in enumerate(lists)}
        weights = {rid: w for items in lists for rid, w in items}
        decision = rb.decide(layout, self.graph_sizes, self.policy, self.capacity, weights)
        if not decision.rebalance:  # judge and decide read the same counts
            raise MigrateError(f"the DP ranks' plans disagree: {decision.reason}")
        self.stats.rebalances += 1
        self.stats.moves += len(decision.moves)
        return True, decision.moves

    def move(self, moves: Sequence[rb.Move], payloads: Mapping[int, Any]) -> dict[int, Any]:
        received, sent = transfer(moves, payloads, self.group, self.kv_group)
        self.stats.sent_bytes += sent
        return received

    def restore(self, finished: Mapping[int, Any]) -> list[Any]:
        """This rank's original requests' outputs, in their original order, wherever they finished.
        ``finished``: request id -> output, for the requests that finished on this rank."""
        if not self.original:
            raise MigrateError("Lockstep.restore before begin")
        home = {rid: r for r, ids in self.original.items() for rid in ids}
        away = [rb.Move(rid, self.rank, home[rid]) for rid in sorted(finished) if home.get(rid) != self.rank]
        lists: list[Any] = [None] * self.size
        dist.all_gather_object(lists, [(m.request, m.dst) for m in away], group=self.group)
        back = [rb.Move(rid, src, dst) for src, items in enumerate(lists) for rid, dst in items]
        received, sent = transfer(back, {m.request: finished[m.request] for m in away}, self.group)
        self.stats.sent_bytes += sent
        self.stats.returned += len(away)
        here = [(rid, out) for rid, out in finished.items() if home.get(rid) == self.rank] + list(received.items())
        return rb.restore({self.rank: self.original[self.rank]}, {self.rank: here})[self.rank]


def eager_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Every batch size from 1 to ``max_num_seqs``: the graph sizes of an eager engine (no captured graph),
    whose DP group steps at its fullest rank's batch; the policy then evens the ranks out."""
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise MigrateError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
    return tuple(range(1, max_num_seqs + 1))
