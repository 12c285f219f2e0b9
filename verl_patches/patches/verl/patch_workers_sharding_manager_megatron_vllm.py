"""Entering rollout runs the switch schedule with our reshard engine writing straight into vLLM's
parameters.

Upstream: verl/workers/sharding_manager/megatron_vllm.py:MegatronVLLMShardingManager.__enter__
(verl 0.4.1) reloads offloaded actor params, wakes the engine's weights, runs
per_tensor_generator (PP broadcast, TP all-gather, EP all-gather to full tensors, HF names) into
vLLM's load_weights, offloads the actor params, wakes the KV cache and swaps the RNG state. It
never redoes vLLM's post-load processing, so MLA's W_UK_T / W_UV (derived from kv_b_proj once
at engine build) stay those of the initial weights.

Ours, for recipe.reshard_method direct (default) or recipe, with the rollout built by patch
verl.vllm_rollout.recipe_engine (which leaves its settings on the engine), makes the calls of the
switch loop's call -> step table that run inside __enter__ (verl_patches/offload/live.py:CALLS,
``calls_inside``), in the loop's order: the engine's wake_up of the weights (an allocation, no copy,
through patch vllm.llm.wake_up_to_onload), the weight sync (reshard from the actor's live parameters
into them and redo MLA's post-load processing, verl_patches.reshard.binding: one plan for the run,
every byte once; then the training params leave: without the worker's loop, verl's own offload when
param_offload is on), the engine's wake_up of the KV cache (created now that the training params
left); then it swaps the RNG state as upstream does. __exit__ is upstream's: sleep(level=1), the
engine's sleep row.
recipe.reshard_method=upstream runs verl's own __enter__ (plus the MLA fix), for comparison.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

logger = logging.getLogger(__name__)
SESSION_ATTR = stash.attr("reshard")


def _settings(manager: Any) -> Any:
    from verl_patches.rollout.settings import ENGINE_ATTR

    return getattr(manager.inference_engine, ENGINE_ATTR, None)


def _model(manager: Any) -> Any:
    return manager.model_runner.model


def _build_session(manager: Any, settings: Any, train: dict, roll: dict, method: str | None = None) -> Any:
    """The run's plan, built on the first switch (every rank together: it agrees the layout)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from verl_patches.reshard.binding import LiveReshard, check_expert_placement
    from verl_patches.reshard.layouts import RolloutLayout

    hf = manager.model_config.to_dict() if hasattr(manager.model_config, "to_dict") else dict(manager.model_config)
    dp = settings.dp
    session = LiveReshard.build(
        hf, rollout=RolloutLayout(tp=dp.tp_size, dp=dp.dp_size, instances=dp.instances),
        tp=mpu.get_tensor_model_parallel_world_size(), pp=mpu.get_pipeline_model_parallel_world_size(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(), layers=settings.num_layer_list, train=train, roll=roll,
        rank=dist.get_rank(), method=method or settings.reshard_method)
    check_expert_placement(_model(manager), session.plan.placements, session.rank)
    setattr(manager, SESSION_ATTR, session)
    s = session.plan.ranks[session.rank]
    logger.info("reshard plan (%s): receive %d B, local %d B, %d collectives, peak extra %d B",
                session.method, s.recv_bytes, s.local_bytes, s.collectives, s.peak_extra_bytes)
    return session


def _swap_rng_for_generation(manager: Any) -> None:
    # Same contract as upstream: every rollout TP rank samples with the same generator state.
    from verl.utils.device import get_torch_device

    if manager.device_mesh is not None:
        manager.torch_random_states = get_torch_device().get_rng_state()
        get_torch_device().set_rng_state(manager.gen_random_states)


def _wake(manager: Any, tag: str) -> None:
    import inspect

    if "tags" in inspect.signature(manager.inference_engine.wake_up).parameters:
        manager.inference_engine.wake_up(tags=[tag])
    elif tag == "weights":
        manager.inference_engine.wake_up()


def switch_figures(stats: Any, ledger: Any, checks: dict[str, float] | None = None) -> dict[str, float]:
    """The switch's own numbers for the run's report (verl_patches/report.py), sent to the driver in
    the timing dict verl returns with every generation (averaged over ranks): what this rank received
    and sent in the reshard, the host-link bytes and resident peak from the switch loop's ledger, and
    the self-checks' figures (``checks``, from self_check)."""
    from verl_patches.report import SWITCH_PREFIX

    out = {f"{SWITCH_PREFIX}reshard_recv_bytes": float(stats.recv_bytes),
           f"{SWITCH_PREFIX}reshard_sent_bytes": float(stats.sent_bytes)}
    out.update({f"{SWITCH_PREFIX}{k}": float(v) for k, v in (checks or {}).items()})
    if ledger is not None:
        # Since the previous switch: the update's onloads, the reference's, and this switch's offloads.
        last = stash.get(ledger, "moved_reported", 0)
        out[f"{SWITCH_PREFIX}link_bytes"] = float(ledger.moved_bytes - last)
        out[f"{SWITCH_PREFIX}ledger_peak_bytes"] = float(ledger.peak_bytes)
        stash.put(ledger, "moved_reported", ledger.moved_bytes)
    return out


def self_check(manager: Any, session: Any, settings: Any, train: dict, model: Any) -> dict[str, float]:
    """The run's per-switch proof that the rollout holds the trainer's weights (after the reshard and
    MLA's redo, before the training params leave): the weight fingerprint of every rollout parameter
    against what the training side sent (verl_patches/reshard/checksum.py), every
    ``recipe.fingerprint_every`` switches, and MLA's derived tensors of one layer (a different one each
    switch) re-derived from the new kv_b_proj. A difference stops the run with WeightMismatchError /
    MLADerivedError naming the step, rank and tensor. ``VERL_PATCHES_INJECT_FAULT`` (tests only,
    verl_patches/reshard/faults.py) corrupts one parameter first."""
    from verl_patches.reshard import faults
    from verl_patches.reshard.binding import vllm_params
    from verl_patches.rollout.mla import check_mla_derived

    step = stash.get(manager, "step")
    roll = vllm_params(model)
    faults.inject_after_reshard(step, session.rank, roll)
    every = settings.fingerprint_every
    out = {"fingerprint_passed": 0.0, "fingerprint_params": 0.0, "fingerprint_s": 0.0, "fingerprint_bytes": 0.0}
    if every and session.switches % every == 0:
        res = session.verify(train, roll, step=step)
        out.update(fingerprint_passed=1.0, fingerprint_params=res.params, fingerprint_s=res.seconds,
                   fingerprint_bytes=res.bytes_read)
        out["mla_layers_checked"] = float(check_mla_derived(model, session.switches // every))
    session.switches += 1
    return out


def upstream_self_check(manager: Any, settings: Any, model: Any) -> dict[str, float]:
    """verl's own reshard (reshard_method=upstream) checked like ours, against the direct method's
    plan. Run when verl's __enter__ asks for the KV cache: its weights are loaded and the training
    params still resident (under the switch loop the KV cache's step first runs offload_train_params;
    without the loop, only when verl's param offload is off). {} when they are not resident."""
    from verl_patches.reshard.binding import megatron_params, vllm_params
    from verl_patches.rollout.mla import redo_mla_post_load

    if stash.get(manager, "actor_memory") is None and manager.offload_param:
        return {}
    redo_mla_post_load(model, next(model.parameters()).dtype)
    train = megatron_params(manager.actor_module)
    session = getattr(manager, SESSION_ATTR, None) or _build_session(manager, settings, train, vllm_params(model),
                                                                     method="direct")
    return self_check(manager, session, settings, train, model)


def upstream_enter(manager: Any, settings: Any, original: Callable[..., Any]) -> Any:
    """verl's __enter__ as shipped, plus MLA's redo and the self-check right before it wakes the KV
    cache (an instance attribute over LLM.wake_up for the duration of the call)."""
    from verl_patches.report import SWITCH_PREFIX
    from verl_patches.rollout.mla import redo_mla_post_load

    engine, model = manager.inference_engine, _model(manager)
    wake_up = engine.wake_up
    checks: dict[str, float] = {}
    ran = []

    def wake_up_checked(tags: Optional[list[str]] = None):
        if tags and "kv_cache" in tags and not ran:
            ran.append(True)
            checks.update(upstream_self_check(manager, settings, model))
        return wake_up(tags=tags)

    engine.wake_up = wake_up_checked
    try:
        out = original(manager)
    finally:
        del engine.wake_up
    if not ran:  # verl did not wake the KV cache through tags (an engine without them)
        redo_mla_post_load(model, next(model.parameters()).dtype)
    checks["graph_addresses_checked"] = _addresses_checked(manager)
    manager.timing.update({f"{SWITCH_PREFIX}{k}": float(v) for k, v in checks.items()})
    return out


def _addresses_checked(manager: Any) -> float:
    """Captured-graph addresses the engine's groups compared since the previous report (graph mode)."""
    memory = stash.get(manager.inference_engine, "memory")
    if memory is None or not hasattr(memory, "addresses_checked"):
        return 0.0
    total = memory.addresses_checked()
    last = stash.get(manager, "addresses_reported", 0)
    stash.put(manager, "addresses_reported", total)
    return float(total - last)


def memory_figures(switch: Any) -> dict[str, float]:
    """The device's watermarks per step of the switch loop (verl_patches/offload/live.py), for the report:
    ``switch/mem/<step>/allocated_peak_bytes`` and ``.../reserved_peak_bytes`` for every step of the loop
    (the latest measurement of each; 0 until a step first ran), and their maxima over what ran since the
    previous switch, excursions included, as ``switch/device_allocated_peak_bytes`` and
    ``switch/device_reserved_peak_bytes``. The maximum over ranks is taken here: verl's timing channel
    then averages equal values. Nothing on the CPU platform (the loop measures no device there); the
    keys are the same on every rank (the loop's steps), as verl's average needs."""
    from verl_patches.report import DEVICE_PEAKS, MEM_PREFIX

    if switch is None or not switch.measure_device:
        return {}
    ledger = switch.ledger
    last = stash.get(ledger, "mem_reported", None)
    fresh: dict[str, tuple[int, int]] = {}
    for entry in reversed(ledger.entries):
        if entry is last:
            break
        if entry.measured_peak is not None:
            a, r = fresh.get(entry.step, (0, 0))
            fresh[entry.step] = (max(a, entry.measured_peak), max(r, entry.measured_reserved_peak or 0))
    if ledger.entries:
        stash.put(ledger, "mem_reported", ledger.entries[-1])
    names = [s.name for s in switch.steps]
    known = stash.get(switch, "mem_known", None) or {}
    known.update({k: v for k, v in fresh.items() if k in names})
    stash.put(switch, "mem_known", known)
    out = {}
    for name in names:
        a, r = known.get(name, (0, 0))
        out[f"{MEM_PREFIX}{name}/allocated_peak_bytes"] = float(a)
        out[f"{MEM_PREFIX}{name}/reserved_peak_bytes"] = float(r)
    out[DEVICE_PEAKS[0]] = float(max((a for a, _ in fresh.values()), default=0))
    out[DEVICE_PEAKS[1]] = float(max((r for _, r in fresh.values()), default=0))
    return _max_over_ranks(out)


def _max_over_ranks(figures: dict[str, float]) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from verl_patches import accelerator

    if not figures or not dist.is_initialized():
        return figures
    keys = sorted(figures)
    values = torch.tensor([figures[k] for k in keys], dtype=torch.float32, device=accelerator.current_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(keys, values.tolist()))


def weight_sync(manager: Any, switch: Any, reshard: Callable[[], Any]) -> Any:
    """The weight sync: ``reshard`` (which returns its statistics), then the training params leave.
    Under the switch loop, its row of the call -> step table; without it (no actor attached), verl's
    own offload when param_offload is on."""
    if switch is not None:
        from verl_patches.offload.live import WEIGHT_SYNC

        return switch.run_call(WEIGHT_SYNC, reshard)
    from verl.utils.megatron_utils import offload_megatron_model_to_cpu

    from verl_patches import accelerator

    stats = reshard()
    if manager.offload_param:
        offload_megatron_model_to_cpu(manager.actor_module)
    accelerator.empty_cache()
    return stats


def enter_calls(manager: Any, weight_sync: Callable[[], Any], steps: Any = None) -> Any:
    """The calls of the switch loop's call -> step table made inside __enter__ (live.py's
    ``calls_inside``), in the order of the loop's ``steps`` (default: our_steps()): the engine's
    wake_up per tag, and ``weight_sync``. Returns what ``weight_sync`` returns."""
    from verl_patches.offload.live import SHARDING_ENTER, WAKE_TAGS, WEIGHT_SYNC, calls_inside, wake_call
    from verl_patches.offload.schedule import ScheduleError

    does: dict[str, Callable[[], Any]] = {wake_call(t): functools.partial(_wake, manager, t) for t in WAKE_TAGS}
    does[WEIGHT_SYNC] = weight_sync
    out = None
    for row in calls_inside(SHARDING_ENTER, steps):
        if row.name not in does:
            raise ScheduleError(f"the switch loop's call {row.name!r} runs inside {SHARDING_ENTER}, which does not "
                                f"make it (it makes {sorted(does)})")
        result = does[row.name]()
        if row.name == WEIGHT_SYNC:
            out = result
    return out


def recipe_enter(manager: Any, settings: Any) -> None:
    from verl.utils.debug.performance import simple_timer
    from verl.utils.megatron_utils import load_megatron_model_to_gpu

    from verl_patches import accelerator
    from verl_patches.reshard.binding import megatron_params, vllm_params
    from verl_patches.rollout.mla import redo_mla_post_load

    manager.timing = {}
    # Under the switch loop when the worker attached its actor (verl_patches/offload/live.py).
    switch = None
    if stash.get(manager, "actor_memory") is not None:
        from verl_patches.offload.live import live_switch

        switch = live_switch()
    with simple_timer("reshard", manager.timing):
        accelerator.empty_cache()
        if switch is None and manager.offload_param:
            load_megatron_model_to_gpu(manager.actor_module)
        model = _model(manager)
        train = megatron_params(manager.actor_module)
        # Planned once (and checked against both models' shapes) before anything is allocated.
        session = getattr(manager, SESSION_ATTR, None) or _build_session(manager, settings, train,
                                                                         vllm_params(model))
        checks: dict[str, float] = {}

        def reshard():
            roll = vllm_params(model)
            stats = session.run(train, roll)
            redo_mla_post_load(model, next(iter(roll.values())).dtype)
            checks.update(self_check(manager, session, settings, train, model))
            return stats

        stats = enter_calls(manager, functools.partial(weight_sync, manager, switch, reshard),
                            None if switch is None else switch.steps)
    checks["graph_addresses_checked"] = _addresses_checked(manager)
    manager.timing.update(switch_figures(stats, None if switch is None else switch.ledger, checks))
    manager.timing.update(memory_figures(switch))
    _swap_rng_for_generation(manager)


def wrap_enter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __enter__(self):
        settings = _settings(self)
        if settings is None:  # a rollout not built by the recipe's constructor: upstream throughout
            return original(self)
        if settings.reshard_method == "upstream":
            out = upstream_enter(self, settings, original)
        else:
            out = recipe_enter(self, settings)
        # The generation's own figures (the rollout's rebalance, rollout/...) go into the same dict,
        # verl's one channel from the generation workers to the driver's metrics.
        stash.put(self.inference_engine, "timing", self.timing)
        return out

    return __enter__


PATCHES = [
    Patch(
        feature="reshard",
        id="verl.sharding_manager.reshard",
        target="verl.workers.sharding_manager.megatron_vllm:MegatronVLLMShardingManager.__enter__",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(signature="def __enter__(self)", source_sha="e074f2d0350cc042"),
        replacement=f"{__name__}:wrap_enter",
        flag="actor_rollout_ref.rollout.recipe.reshard_method (direct | recipe | upstream), "
             "actor_rollout_ref.rollout.recipe.megatron.num_layer_list",
        why="Upstream gathers every parameter to full tensors on every rank (about the whole model per rank, "
            "14 GB transient for one layer's experts at EP256) and lets vLLM slice; ours routes each byte once "
            "from a training owner to the rollout rank that needs it, straight into vLLM's parameters, in the "
            "switch schedule's order (weights allocated, reshard, training params offloaded, then the KV cache), "
            "and redoes MLA's post-load processing, which upstream leaves stale after the weights change "
            "(docs/RECIPE.md item 1; docs/DESIGN.md sections 2 and 3).",
        remove_when="verl's Megatron-to-vLLM weight sync sends each rollout rank only its shard (no full-tensor "
                    "gathers) and re-runs vLLM's process_weights_after_loading after updating weights.",
    ),
]
