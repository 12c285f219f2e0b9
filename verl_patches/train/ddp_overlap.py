"""megatron-core's data-parallel communication overlap, as the recipe turns it on (docs/DESIGN.md,
"Gradient-reduce and parameter-gather overlap").

Two recipe keys (``recipe.overlap_grad_reduce``, ``recipe.overlap_param_gather``, read by
verl_patches/config/settings.py) become megatron-core 0.12.1's DistributedDataParallelConfig fields of the
same names, plus what megatron's own training loop sets with them and verl 0.4.1 never does:

- ``overlap_grad_reduce``: DDP's backward hooks launch each DDP bucket's reduce-scatter (distributed
  optimizer) or all-reduce asynchronously as soon as every gradient of the DDP bucket is ready;
  ``finalize_model_grads`` (which verl's actor installs) only waits for them. The schedules must
  then run all micro-batches but the last under ``config.no_sync_func`` (DDP.no_sync), else the
  second micro-batch's hooks find their DDP bucket already launched; megatron's training loop also
  sets ``config.grad_sync_func`` (DDP.start_grad_sync), with which the pipelined schedule
  launches the later stages' reductions right after their last backward.
- ``overlap_param_gather`` (needs the distributed optimizer: without it every rank holds whole
  parameters and nothing is gathered): the optimizer step no longer all-gathers the updated
  shards; forward pre-hooks on every module wait for their DDP bucket's gather and dispatch the next
  one. ``align_param_gather`` (all stages dispatch together through ``config.param_sync_func``) is
  set exactly when there are virtual pipeline chunks: only the interleaved schedule calls
  param_sync_func, and with it set but never called each DDP bucket would be gathered synchronously
  at its first use.

Until the next forward every rank's parameters outside its own shard are those of before the
step. In verl the next reader is not a forward: the reshard sends the parameters to the rollout
right after the update, the switch offloads them, a checkpoint saves them. ``complete_param_gather``
therefore finishes every gather still due at the end of an update (patch
verl.ddp_overlap.update_policy); the overlap with compute remains between the optimizer steps of
one update (several mini-batches or epochs). ``pending_communication`` names an in-flight
collective or a stale DDP bucket, which the offload of the params or grads refuses.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from verl_patches.config import settings

# For the patches that bind it (verl_patches/patches/verl/*ddp_overlap.py): the flag they name, when
# they can go, and the actor's overlap while its _build_model_optimizer runs (get_model receives no config).
FLAG = "actor_rollout_ref.rollout.recipe.overlap_grad_reduce / overlap_param_gather (default false: upstream's DDP)"
REMOVE_WHEN = ("verl passes a DDP config override to get_model (later verl has actor.megatron.override_ddp_config) "
               "and finishes the deferred parameter gather before the weights leave the actor.")
OVERLAP: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("verl_patches_ddp_overlap", default=None)

KEYS = ("overlap_grad_reduce", "overlap_param_gather")


class DdpOverlapError(ValueError):
    """A DDP overlap setting that cannot work (or would make results silently wrong); the message
    names the key and the fix."""


@dataclass(frozen=True)
class DdpOverlap:
    overlap_grad_reduce: bool = settings.KEYS["overlap_grad_reduce"].default
    overlap_param_gather: bool = settings.KEYS["overlap_param_gather"].default

    @property
    def on(self) -> bool:
        return self.overlap_grad_reduce or self.overlap_param_gather

    @classmethod
    def from_worker(cls, worker_config: Any) -> "DdpOverlap":
        """From a worker's config (verl's actor_rollout_ref section)."""
        recipe = settings.from_worker(worker_config)
        return cls(**{k: getattr(recipe, k) for k in KEYS})

    @classmethod
    def from_trainer(cls, config: Any) -> "DdpOverlap":
        recipe = settings.from_trainer(config)
        return cls(**{k: getattr(recipe, k) for k in KEYS})


def ddp_config_values(overlap: DdpOverlap, *, use_distributed_optimizer: Any, num_chunks: int) -> dict[str, Any]:
    """DistributedDataParallelConfig keyword arguments for verl's actor: upstream's own three
    (grad_reduce_in_fp32=True, use_distributed_optimizer as verl passes it, overlap off) with the
    recipe's overlap and what it needs. Raises DdpOverlapError for a combination that cannot work."""
    if not isinstance(use_distributed_optimizer, bool):
        raise DdpOverlapError(f"actor.megatron.use_distributed_optimizer must be true or false, got "
                              f"{use_distributed_optimizer!r}")
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        raise DdpOverlapError(f"expected at least one model chunk, got {num_chunks!r}")
    if overlap.overlap_param_gather and not use_distributed_optimizer:
        raise DdpOverlapError(
            f"{settings.SECTION}.overlap_param_gather needs actor_rollout_ref.actor.megatron.use_distributed_optimizer="
            "True: megatron-core gathers the distributed optimizer's updated shards; without it every rank steps "
            "whole parameters and there is nothing to gather (turn overlap_param_gather off, or the distributed "
            "optimizer on)")
    return {
        "grad_reduce_in_fp32": True,
        "use_distributed_optimizer": use_distributed_optimizer,
        "overlap_grad_reduce": overlap.overlap_grad_reduce,
        "overlap_param_gather": overlap.overlap_param_gather,
        "align_param_gather": overlap.overlap_param_gather and num_chunks > 1,
    }


class SyncHook:
    """One chunk's DDP method as the model config holds it. The config is a dataclass that verl's
    checkpoint manager turns into a dict (``dataclasses.asdict``, which deep-copies every value)
    before it drops the callables and writes the rest as JSON: a bound method would deep-copy its
    DDP module and fail on its non-leaf tensors, so the hook copies as itself."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __copy__(self) -> "SyncHook":
        return self

    def __deepcopy__(self, memo: dict) -> "SyncHook":
        return self

    def __repr__(self) -> str:
        return f"SyncHook({getattr(self.fn, '__qualname__', self.fn)!r})"


class SyncHooks(list):
    """One hook per virtual pipeline chunk (megatron's schedules require a list). Callable only so that
    verl's checkpoint manager, which drops callable config values before writing the config as JSON,
    drops it too; calling it is an error."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a list of per-chunk sync hooks: call one element per model chunk")


def _one_or_list(fns: list[Any]) -> Any:
    hooks = [SyncHook(f) for f in fns]
    return hooks[0] if len(hooks) == 1 else SyncHooks(hooks)


def wire_sync_funcs(config: Any, chunks: list[Any]) -> list[str]:
    """Set on the model config (megatron's TransformerConfig the schedules read) the hooks megatron's
    training loop sets for the chunks' DDP configs; returns the names set. A hook already set by
    someone else is an error: two owners of one hook would silently drop one's synchronisation."""
    if not chunks:
        raise DdpOverlapError("no DDP model chunks to wire")
    ddp = chunks[0].ddp_config
    want: dict[str, list[Any]] = {}
    if ddp.overlap_grad_reduce:
        want["no_sync_func"] = [c.no_sync for c in chunks]
        want["grad_sync_func"] = [c.start_grad_sync for c in chunks]
    if ddp.overlap_param_gather and ddp.align_param_gather:
        want["param_sync_func"] = [c.start_param_sync for c in chunks]
    taken = [name for name in want if getattr(config, name, None) is not None]
    if taken:
        raise DdpOverlapError(f"the model config's {', '.join(taken)} is already set (by {getattr(config, taken[0])!r}); "
                              "the DDP overlap would replace another owner's synchronisation")
    for name, fns in want.items():
        setattr(config, name, _one_or_list(fns))
    return sorted(want)


def bucket_groups(chunk: Any) -> list[Any]:
    """A DDP chunk's (megatron-core's DDP) bucket groups, dense and expert-parallel."""
    return list(getattr(chunk, "bucket_groups", [])) + list(getattr(chunk, "expert_parallel_bucket_groups", []))


def _gathers_in_forward(chunk: Any) -> bool:
    ddp = getattr(chunk, "ddp_config", None)
    return bool(ddp is not None and ddp.use_distributed_optimizer and ddp.overlap_param_gather)


def mark_gathered(chunks: Iterable[Any]) -> None:
    """Freshly built (and broadcast) parameters are whole on every rank: no gather is due before the
    first step. Without this mark the first forward would gather them again, and
    ``pending_communication`` could not tell a fresh model from a stepped one."""
    for chunk in chunks:
        if _gathers_in_forward(chunk):
            for group in bucket_groups(chunk):
                if group.param_gather_handle is None:
                    group.param_gather_dispatched = True


def complete_param_gather(chunks: Iterable[Any]) -> int:
    """Finish every parameter all-gather still due (dispatched and in flight, or not dispatched since
    the last step), synchronously; returns how many DDP bucket groups it finished. Every data-parallel
    rank runs the same schedule, so each issues the same gathers."""
    n = 0
    for chunk in chunks:
        if not _gathers_in_forward(chunk):
            continue
        for group in bucket_groups(chunk):
            if group.param_gather_handle is not None or not group.param_gather_dispatched:
                group.start_param_sync(force_sync=True)
                if group.param_gather_handle is not None:  # force_sync waited an in-flight one; it is done
                    group.param_gather_handle = None
                group.param_gather_dispatched = True
                n += 1
    return n


def pending_communication(chunks: Iterable[Any]) -> list[str]:
    """What makes the chunks' params or grads unsafe to move now: an asynchronous reduce or gather in
    flight (it would write into a freed buffer), or parameters not gathered since the last optimizer
    step (the shards of other ranks are stale). [] when none."""
    out = []
    for i, chunk in enumerate(chunks):
        for j, group in enumerate(bucket_groups(chunk)):
            where = f"chunk {i} DDP bucket group {j}"
            if getattr(group, "grad_reduce_handle", None) is not None:
                out.append(f"{where}: a gradient reduce is in flight (finish_grad_sync not reached)")
            if getattr(group, "param_gather_handle", None) is not None:
                out.append(f"{where}: a parameter all-gather is in flight")
            elif _gathers_in_forward(chunk) and not group.param_gather_dispatched:
                out.append(f"{where}: parameters not gathered since the last optimizer step "
                           "(verl_patches.train.ddp_overlap.complete_param_gather was not run)")
    return out


def check_settled(chunks: Iterable[Any], what: str) -> None:
    problems = pending_communication(chunks)
    if problems:
        raise DdpOverlapError(f"{what}: megatron-core's overlapped DDP communication is not settled: "
                              + "; ".join(problems))


__all__ = ["DdpOverlap", "DdpOverlapError", "KEYS", "SyncHook", "SyncHooks", "bucket_groups", "check_settled", "complete_param_gather",
           "ddp_config_values", "mark_gathered", "pending_communication", "wire_sync_funcs"]
