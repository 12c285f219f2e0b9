"""The weight update from the trainer to the rollout engine, with one owner for its lifecycle (``WeightSync``).

1. Plan, once per run (``WeightSync.build``): every rank together derives the training layout from what it
   stores and the rollout layout from vLLM's model, builds the same plan, and checks both models' shapes
   against it.
2. Per switch (``WeightSync.sync``):
   a. move (``move``): the method's collectives write the trained weights straight into vLLM's parameters;
   b. redo MLA's derived tensors (``W_UK_T`` / ``W_UV``) from the new ``kv_b_proj`` (verl_patches/rollout/mla.py);
   c. verify (``check``): every ``fingerprint_every`` switches, the weight fingerprint of every rollout parameter
      against what the training side sent (verl_patches/reshard/checksum.py), and one MLA layer re-derived.

One implementation per method of ``recipe.reshard_method`` (``WEIGHT_SYNCS``; the names and what each is are
declared beside the setting, verl_patches/config/settings.py ``METHOD_DOCS``), chosen once by ``for_method``:
``DirectSliceRouting`` (ours, verl_patches/reshard/direct.py), ``ReferenceAlltoAllV`` (the reference recipe's,
verl_patches/reshard/alltoallv.py) and ``VerlFullGather`` (verl 0.4.1's, verl_patches/reshard/baselines.py).

Example:
    sync = for_method(settings.recipe.reshard_method).build(hf_config, rollout=layout, tp=2, pp=2, pp_rank=0,
                                                             layers=None, train=train, roll=roll, rank=rank)
    stats, checks = sync.sync(train, model, step=step, fingerprint_every=1)   # every switch
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping

import torch
import torch.distributed as dist

from verl_patches.config.settings import BUCKET_BYTES, KEYS, METHODS
from verl_patches.reshard import faults
from verl_patches.reshard.alltoallv import alltoallv_stats, execute_alltoallv
from verl_patches.reshard.baselines import execute_upstream, upstream_stats
from verl_patches.reshard.binding import (DTYPE_NAMES, as_rollout_dtype, derive_rollout_layout, derive_train_layout,
                                          vllm_params)
from verl_patches.reshard.checksum import verify
from verl_patches.reshard.direct import check_inputs, execute_direct
from verl_patches.reshard.layouts import RolloutLayout
from verl_patches.reshard.model import LayoutError, ModelConfig
from verl_patches.reshard.placements import build_placements
from verl_patches.reshard.planner import Plan, RankStats, build_plan, summarize
from verl_patches.reshard.stats import ExecStats
from verl_patches.rollout.mla import check_mla_derived, redo_mla_post_load


@dataclass
class WeightSync:
    """One plan for the run (layouts do not change), and the per-switch sequence on it: move, redo MLA's derived
    tensors, verify. A subclass is one method: its ``name`` (a ``METHODS`` entry) and ``_move``."""

    plan: Plan
    rank: int
    switches: int = 0  # switches synced so far (the fingerprint's every-N count)

    name: ClassVar[str]
    # The method emulates its reference on megatron-core's GroupedMLP storage only (one tensor per expert stack).
    grouped_experts_only: ClassVar[bool] = False
    # In verl's live loop the method is verl's own weight sync (the patch runs upstream's code); this class
    # reproduces it on the plan, for the preflight and the benchmarks.
    runs_in_verl: ClassVar[bool] = False

    @property
    def method(self) -> str:
        return self.name

    @classmethod
    def check_storage(cls, expert_storage: str) -> None:
        if cls.grouped_experts_only and expert_storage != "grouped":
            raise LayoutError(f"reshard method {cls.name!r} emulates its reference on GroupedMLP storage; this model "
                              f"stores experts as {expert_storage!r}: use 'direct' (or verl's own path)")

    @classmethod
    def build(cls, hf_config: Mapping[str, Any], *, rollout: RolloutLayout, tp: int, pp: int, pp_rank: int,
              layers: Iterable[int] | None, train: Mapping[str, torch.Tensor], roll: Mapping[str, torch.Tensor],
              rank: int, bucket_bytes: int = BUCKET_BYTES, group: Any = None) -> "WeightSync":
        """Step 1, the plan: every rank calls it together (the training layout is agreed over ``group``)."""
        cfg = ModelConfig.from_hf(dict(hf_config))
        tl = derive_train_layout(cfg, tp=tp, pp=pp, pp_rank=pp_rank, layers=layers, train=train, group=group)
        cls.check_storage(tl.expert_storage)
        dtypes = {t.dtype for t in roll.values()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_NAMES:
            counts = {d: sum(1 for t in roll.values() if t.dtype == d) for d in dtypes}
            rare = min(counts, key=counts.get)
            odd = [n for n, t in roll.items() if t.dtype == rare][:3]
            raise LayoutError(f"vLLM parameters must share one dtype of {sorted(DTYPE_NAMES.values())}, got "
                              f"{ {str(d): c for d, c in counts.items()} } (e.g. {odd} are {rare}; vLLM-Ascend's "
                              "enable_super_kernel keeps the router in fp32)")
        dtype = DTYPE_NAMES[next(iter(dtypes))]
        rollout = derive_rollout_layout(cfg, rollout, roll)
        P = build_placements(cfg, tl, rollout)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if P.world != world:
            raise LayoutError(f"rollout layout {rollout} covers {P.world} ranks, the process group has {world}")
        check_inputs(P, rank, dict(train), dict(roll))
        plan = build_plan(cfg, tl, rollout, bucket_bytes=bucket_bytes, dtype=dtype, placements=P)
        return cls(plan, rank)

    def sync(self, train: Mapping[str, torch.Tensor], model: torch.nn.Module, *, step: Any,
             fingerprint_every: int) -> tuple[ExecStats, dict[str, float]]:
        """Step 2, one switch: move, redo MLA's derived tensors, verify. Every rank calls it."""
        roll = vllm_params(model)
        stats = self.move(train, roll)
        redo_mla_post_load(model, next(iter(roll.values())).dtype)
        return stats, self.check(train, model, step=step, fingerprint_every=fingerprint_every)

    def move(self, train: Mapping[str, torch.Tensor], roll: Mapping[str, torch.Tensor], group: Any = None) -> ExecStats:
        """Step 2a: fill ``roll`` (vLLM's parameters, allocated) from ``train`` (Megatron's)."""
        return self._move(self.plan, self.rank, as_rollout_dtype(train, next(iter(roll.values())).dtype), dict(roll),
                          group)

    def check(self, train: Mapping[str, torch.Tensor], model: torch.nn.Module, *, step: Any,
              fingerprint_every: int) -> dict[str, float]:
        """Step 2c, the run's per-switch proof that the rollout holds the trainer's weights (after the move and MLA's
        redo, before the training params leave): the weight fingerprint every ``fingerprint_every`` switches and
        MLA's derived tensors of one layer (a different one each time) re-derived from the new kv_b_proj. A
        difference stops the run with WeightMismatchError / MLADerivedError naming the step, rank and tensor.
        ``VERL_PATCHES_INJECT_FAULT`` (tests only, verl_patches/reshard/faults.py) corrupts one parameter first."""
        roll = vllm_params(model)
        faults.inject_after_reshard(step, self.rank, roll)
        out = {"fingerprint_passed": 0.0, "fingerprint_params": 0.0, "fingerprint_s": 0.0, "fingerprint_bytes": 0.0}
        if fingerprint_every and self.switches % fingerprint_every == 0:
            res = self.verify(train, roll, step=step)
            out.update(fingerprint_passed=1.0, fingerprint_params=res.params, fingerprint_s=res.seconds,
                       fingerprint_bytes=res.bytes_read)
            out["mla_layers_checked"] = float(check_mla_derived(model, self.switches // fingerprint_every))
        self.switches += 1
        return out

    def verify(self, train: Mapping[str, torch.Tensor], roll: Mapping[str, torch.Tensor], *, step: Any = None,
               group: Any = None) -> Any:
        """The weight fingerprint of ``roll`` against the training tensors ``move`` read (cast as it cast them).
        Every rank calls it; WeightMismatchError on all."""
        return verify(self.plan, self.rank, as_rollout_dtype(train, next(iter(roll.values())).dtype), roll,
                      step=step, group=group)

    @staticmethod
    def _move(plan: Plan, rank: int, train: dict[str, torch.Tensor], roll: dict[str, torch.Tensor],
              group: Any) -> ExecStats:
        raise NotImplementedError

    @staticmethod
    def costs(plan: Plan) -> list[RankStats]:
        """Per rank: bytes received, collectives and transient memory, from the plan's metadata alone."""
        raise NotImplementedError


class DirectSliceRouting(WeightSync):
    """Ours: every byte moves once, from a training rank that holds it to the rollout rank that needs it, one
    all-to-all per bucket, no full tensor materialised (verl_patches/reshard/direct.py)."""

    name = "direct"

    @staticmethod
    def _move(plan, rank, train, roll, group):
        return execute_direct(plan, rank, train, roll, group)

    @staticmethod
    def costs(plan):
        return plan.ranks


class ReferenceAlltoAllV(WeightSync):
    """The reference recipe's: experts by a PP broadcast and one AlltoAllV in the expert group, dense tensors by a
    TP all-gather and a PP all-to-all of the full tensors (verl_patches/reshard/alltoallv.py)."""

    name = "alltoallv"
    grouped_experts_only = True

    @staticmethod
    def _move(plan, rank, train, roll, group):
        return execute_alltoallv(plan, rank, train, roll)

    @staticmethod
    def costs(plan):
        return alltoallv_stats(plan.placements, plan.elem_size)


class VerlFullGather(WeightSync):
    """verl 0.4.1's: every parameter gathered to full size on every rank, the loader slicing its part out
    (verl_patches/reshard/baselines.py)."""

    name = "upstream"
    grouped_experts_only = True
    runs_in_verl = True

    @staticmethod
    def _move(plan, rank, train, roll, group):
        return execute_upstream(plan, rank, train, roll)

    @staticmethod
    def costs(plan):
        return upstream_stats(plan.placements, plan.elem_size)


WEIGHT_SYNCS: dict[str, type[WeightSync]] = {cls.name: cls for cls in (DirectSliceRouting, VerlFullGather,
                                                                       ReferenceAlltoAllV)}
if set(WEIGHT_SYNCS) != set(METHODS):
    raise ImportError(f"the weight syncs {sorted(WEIGHT_SYNCS)} and the reshard_method names {sorted(METHODS)} "
                      "(verl_patches/config/settings.py) must agree")


def for_method(name: str) -> type[WeightSync]:
    """The implementation of ``recipe.reshard_method`` ``name``: the one place a method name is looked up."""
    if name not in WEIGHT_SYNCS:
        raise ValueError(f"reshard method {name!r}: expected one of {METHODS}")
    return WEIGHT_SYNCS[name]


def execute(plan: Plan, rank: int, train_shards: dict[str, torch.Tensor], rollout_params: dict[str, torch.Tensor],
            group: Any = None, method: str = KEYS["reshard_method"].default, check: bool = True,
            in_flight: int = 2) -> ExecStats:
    """One move without a run's session (the preflight, the tests, the benchmarks): fill ``rollout_params`` (this
    rank's vLLM parameters, preallocated) from ``train_shards`` (its Megatron parameters). All ranks of the plan
    call it together with the same method. ``group`` is the world group (None: the default group). ``in_flight``
    (method direct only): how many buckets are on the links at once, each with its own staging buffer, so the
    extra memory is ``in_flight`` buckets."""
    cls = for_method(method)
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight {in_flight!r}: expected an integer of at least 1 (buckets on the links at once)")
    if cls is not DirectSliceRouting and in_flight != 2:
        raise ValueError(f"in_flight applies to method 'direct' only; method {method!r} runs its reference's schedule")
    P = plan.placements
    if check:
        check_inputs(P, rank, train_shards, rollout_params)
    if cls.grouped_experts_only and P.train.expert_storage != "grouped":
        raise ValueError(f"method {method!r} emulates its reference on GroupedMLP storage; this training "
                         f"layout stores experts as {P.train.expert_storage!r}: use method 'direct'")
    if cls is DirectSliceRouting:
        return execute_direct(plan, rank, train_shards, rollout_params, group, in_flight)
    return cls._move(plan, rank, train_shards, rollout_params, group)


def plan_summaries(plan: Plan) -> list[dict[str, Any]]:
    """One dict per method with max/mean received bytes per rank, total bytes on links, collectives per rank and
    peak extra device memory per rank."""
    return [summarize(name, cls.costs(plan)) for name, cls in WEIGHT_SYNCS.items()]
