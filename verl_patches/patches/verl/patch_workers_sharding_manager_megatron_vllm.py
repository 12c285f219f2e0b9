"""Entering rollout runs the switch loop's calls, with our reshard engine writing straight into
vLLM's parameters.

Upstream: verl/workers/sharding_manager/megatron_vllm.py:MegatronVLLMShardingManager.__enter__
(verl 0.4.1) does, in order:
1. reload the offloaded actor params;
2. wake the engine's weights;
3. run per_tensor_generator (PP broadcast, TP all-gather, EP all-gather to full tensors, HF names)
   into vLLM's load_weights;
4. offload the actor params;
5. wake the KV cache and swap the RNG state.
It never redoes vLLM's post-load processing. So MLA's W_UK_T / W_UV (derived from kv_b_proj once
at engine build) stay those of the initial weights.

What __enter__ and __exit__ do, in order, for a rollout built by patch verl.vllm_rollout.recipe_engine
(which leaves its settings on the engine; any other rollout runs verl's __enter__ unchanged). The
calls in backquotes are rows of the switch loop's call -> step table (verl_patches/offload/live.py:
CALLS), listed in the loop's order with the steps each runs; ``sequence()`` renders this text from
them and tests/offload/test_switch_calls.py checks that it is here.

__enter__, recipe.reshard_method direct (default) or alltoallv:
1. Training params on the device: without the switch loop (no actor attached) and with param_offload
   on, verl's load_megatron_model_to_gpu; under the loop they are there already.
2. Plan, on the first switch only: every rank together builds the run's weight sync for
   recipe.reshard_method (direct or alltoallv; WeightSync.build) and checks its plan against both
   models' shapes and the experts' placement; it stays on the manager.
3. `LLM.wake_up(tags=['weights'])`, step `alloc_rollout_weights` (allocate(rollout_weights)): the
   engine's weights region comes back allocated, no copy (under the switch loop, through patch
   vllm.llm.wake_up_to_onload); the reshard fills every byte.
4. `the sharding manager's weight sync`, steps `reshard` (call(reshard)), `offload_train_params`
   (offload(train_params), empty_cache): the run's weight sync (verl_patches/reshard/weight_sync.py,
   WeightSync.sync) moves the weights by its plan from the actor's live parameters straight into
   vLLM's: direct moves every byte once, one all-to-all per transfer bucket; alltoallv runs the
   reference's expert AlltoAllV, dense TP all-gather and PP all-to-all. It redoes MLA's post-load
   processing (W_UK_T / W_UV from the new kv_b_proj) and, every recipe.fingerprint_every-th switch,
   verifies: the fingerprint of every rollout parameter against what the trainer sent and one
   layer's MLA tensors re-derived; a difference stops the run. Then the training params leave the
   device (without the switch loop: verl's offload_megatron_model_to_cpu when param_offload is on).
5. `LLM.wake_up(tags=['kv_cache'])`, step `init_kv_cache` (allocate(kv_cache)): the KV cache is
   allocated in the memory the training params freed.
6. Report: the switch's figures go into the manager's timing dict
   (verl_patches/reporting/switch_report.py): the reshard's bytes, the ledger's host-link bytes and
   peak, the self-check's figures, the captured-graph addresses audited, the device's watermarks per
   step.
7. RNG: the generation's RNG state is swapped in, as upstream does.

__enter__, recipe.reshard_method upstream (verl's own, for comparison):
1. verl's __enter__ as shipped: the training params come to the device when param_offload is on.
2. `LLM.wake_up(tags=['weights'])`, reaches step `alloc_rollout_weights`
   (allocate(rollout_weights)): as above.
3. verl's weight sync, which the loop counts as its `reshard` step: per_tensor_generator (PP
   broadcast, TP all-gather, EP all-gather to full tensors, HF names) into vLLM's load_weights; then
   verl's offload_megatron_model_to_cpu when param_offload is on.
4. Ours, when verl asks for the KV cache: MLA's post-load processing redone; then, if the training
   params are still on the device (under the switch loop, or param_offload off), the self-check
   against the direct method's plan. An engine whose wake_up takes no tags gets MLA's redo after
   verl's __enter__.
5. `LLM.wake_up(tags=['kv_cache'])`, reaches step `init_kv_cache` (allocate(kv_cache)): under the
   switch loop the steps before it run first (`offload_train_params`), then the KV cache is
   allocated.
6. Report: the self-check's figures and the captured-graph addresses audited only.
7. RNG: verl's swap.

__exit__ (verl's, not wrapped):
1. `LLM.sleep`, steps `generate` (call(generate)), `free_kv_cache` (release(kv_cache)),
   `release_rollout_weights` (release(rollout_weights)): under the switch loop (patch
   vllm.llm.sleep_to_offload) the generation's step closes and the KV cache, then the rollout
   weights, are released, no copy to host; without it vLLM's sleep(level=1).
2. verl's: the actor's modules back to train mode, empty_cache, the training RNG state restored.
"""

from __future__ import annotations

import functools
import inspect
import logging
import textwrap
from typing import Any, Callable, Optional

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.reporting.report import SWITCH_PREFIX
from verl_patches.reshard.layouts import RolloutLayout
from verl_patches.rollout.settings import STASH_KEY

logger = logging.getLogger(__name__)
SESSION_ATTR = stash.attr("reshard")


def _settings(manager: Any) -> Any:
    return stash.get(manager.inference_engine, STASH_KEY)


def _model(manager: Any) -> Any:
    return manager.model_runner.model


def _build_session(manager: Any, settings: Any, train: dict, roll: dict, method: str | None = None) -> Any:
    """The run's plan, built on the first switch (every rank together: it agrees the layout)."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from verl_patches.reshard.binding import check_expert_placement
    from verl_patches.reshard.weight_sync import for_method

    hf = manager.model_config.to_dict() if hasattr(manager.model_config, "to_dict") else dict(manager.model_config)
    dp = settings.dp
    session = for_method(method or settings.recipe.reshard_method).build(
        hf, rollout=RolloutLayout(tp=dp.tp_size, dp=dp.dp_size, instances=dp.instances),
        tp=mpu.get_tensor_model_parallel_world_size(), pp=mpu.get_pipeline_model_parallel_world_size(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(), layers=settings.num_layer_list, train=train, roll=roll,
        rank=dist.get_rank(), bucket_bytes=settings.recipe.reshard_bucket_mb << 20)
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
    if "tags" in inspect.signature(manager.inference_engine.wake_up).parameters:
        manager.inference_engine.wake_up(tags=[tag])
    elif tag == "weights":
        manager.inference_engine.wake_up()


def self_check(manager: Any, session: Any, settings: Any, train: dict, model: Any) -> dict[str, float]:
    """The weight sync's verify step (verl_patches/reshard/weight_sync.py ``WeightSync.check``) at this switch's
    step, every ``recipe.fingerprint_every`` switches."""
    return session.check(train, model, step=stash.get(manager, "step"),
                         fingerprint_every=settings.recipe.fingerprint_every)


def upstream_self_check(manager: Any, settings: Any, model: Any) -> dict[str, float]:
    """verl's own reshard (reshard_method=upstream) checked like ours, against the direct method's
    plan. Run when verl's __enter__ asks for the KV cache: its weights are loaded and the training
    params still resident (under the switch loop the KV cache's step first runs offload_train_params;
    without the loop, only when verl's param offload is off). MLA's post-load processing is redone in
    every case; the self-check's figures are {} when the training params are not resident."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.reshard.binding import megatron_params, vllm_params
    from verl_patches.rollout.mla import redo_mla_post_load

    # MLA's redo needs only vLLM's new kv_b_proj: always, before the self-check, which needs the
    # training params too.
    redo_mla_post_load(model, next(model.parameters()).dtype)
    if stash.get(manager, "actor_memory") is None and manager.offload_param:
        return {}
    train = megatron_params(manager.actor_module)
    session = getattr(manager, SESSION_ATTR, None) or _build_session(manager, settings, train, vllm_params(model),
                                                                     method="direct")
    return self_check(manager, session, settings, train, model)


def upstream_enter(manager: Any, settings: Any, original: Callable[..., Any]) -> Any:
    """verl's __enter__ as shipped, plus MLA's redo and the self-check right before it wakes the KV
    cache (an instance attribute over LLM.wake_up for the duration of the call)."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.rollout.mla import redo_mla_post_load
    from verl_patches.reporting.switch_report import addresses_checked

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
    checks["graph_addresses_checked"] = addresses_checked(manager)
    manager.timing.update({f"{SWITCH_PREFIX}{k}": float(v) for k, v in checks.items()})
    return out


def weight_sync(manager: Any, switch: Any, reshard: Callable[[], Any]) -> Any:
    """The weight sync: ``reshard`` (which returns its statistics), then the training params leave.
    Under the switch loop, its row of the call -> step table; without it (no actor attached), verl's
    own offload when param_offload is on."""
    if switch is not None:
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.offload.live import WEIGHT_SYNC

        return switch.run_call(WEIGHT_SYNC, reshard)
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl.utils.megatron_utils import offload_megatron_model_to_cpu
    from verl_patches.base import accelerator

    stats = reshard()
    if manager.offload_param:
        offload_megatron_model_to_cpu(manager.actor_module)
    accelerator.empty_cache()
    return stats


def enter_calls(manager: Any, weight_sync: Callable[[], Any], steps: Any = None) -> Any:
    """The calls of the switch loop's call -> step table made inside __enter__ (live.py's
    ``calls_inside``), in the order of the loop's ``steps`` (default: our_steps()): the engine's
    wake_up per tag, and ``weight_sync``. Returns what ``weight_sync`` returns."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
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
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl.utils.debug.performance import simple_timer
    from verl.utils.megatron_utils import load_megatron_model_to_gpu
    from verl_patches.base import accelerator
    from verl_patches.reshard.binding import megatron_params, vllm_params
    from verl_patches.reporting.switch_report import addresses_checked, memory_figures, switch_figures

    manager.timing = {}
    # Under the switch loop when the worker attached its actor (verl_patches/offload/live.py).
    switch = None
    if stash.get(manager, "actor_memory") is not None:
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
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
            stats, figures = session.sync(train, model, step=stash.get(manager, "step"),
                                          fingerprint_every=settings.recipe.fingerprint_every)
            checks.update(figures)
            return stats

        stats = enter_calls(manager, functools.partial(weight_sync, manager, switch, reshard),
                            None if switch is None else switch.steps)
    checks["graph_addresses_checked"] = addresses_checked(manager)
    manager.timing.update(switch_figures(stats, None if switch is None else switch.ledger, checks))
    manager.timing.update(memory_figures(switch))
    _swap_rng_for_generation(manager)


def wrap_enter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __enter__(self):
        settings = _settings(self)
        if settings is None:  # a rollout not built by the recipe's constructor: upstream throughout
            return original(self)
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.reshard.weight_sync import for_method

        if for_method(settings.recipe.reshard_method).runs_in_verl:
            out = upstream_enter(self, settings, original)
        else:
            out = recipe_enter(self, settings)
        # The generation's own figures (the rollout's rebalance, rollout/...) go into the same dict,
        # verl's one channel from the generation workers to the driver's metrics.
        stash.put(self.inference_engine, "timing", self.timing)
        return out

    return __enter__


# -- the sequence the module's docstring shows ------------------------------------------------

# What each call of the switch loop's table made inside __enter__ does, by its row (its steps come from the table).
_ENTER_DOES = {
    "weights": "the engine's weights region comes back allocated, no copy (under the switch loop, through patch "
               "vllm.llm.wake_up_to_onload); the reshard fills every byte.",
    "sync": "the run's weight sync (verl_patches/reshard/weight_sync.py, WeightSync.sync) moves the weights by "
            "its plan from the actor's live parameters straight into vLLM's: direct moves every byte once, one "
            "all-to-all per transfer bucket; alltoallv runs the reference's expert AlltoAllV, dense TP all-gather "
            "and PP all-to-all. It redoes MLA's post-load processing (W_UK_T / W_UV from the new kv_b_proj) and, "
            "every recipe.fingerprint_every-th switch, verifies: the fingerprint of every rollout parameter "
            "against what the trainer sent and one layer's MLA tensors re-derived; a difference stops the run. "
            "Then the training params leave the device (without the switch loop: verl's "
            "offload_megatron_model_to_cpu when param_offload is on).",
    "kv_cache": "the KV cache is allocated in the memory the training params freed.",
}


def _numbered(title: str, items: list[str]) -> str:
    lines = [title]
    for i, item in enumerate(items, 1):
        lines += textwrap.wrap(f"{i}. {item}", width=100, subsequent_indent="   ", break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def sequence(steps: Any = None) -> str:
    """What __enter__ and __exit__ do, in order, as the module's docstring shows it (tests/offload/
    test_switch_calls.py checks that the docstring holds this text): the switch loop's calls among them
    rendered from its call -> step table (verl_patches/offload/live.py:CALLS, ``calls_inside``) in the
    order of the loop's ``steps`` (default our_steps()), each with the steps it runs and their actions."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.offload.live import SHARDING_ENTER, WEIGHT_SYNC, calls_inside, switch_call, wake_call
    from verl_patches.offload.schedule import our_steps

    spec = {s.name: s for s in (steps if steps is not None else our_steps())}

    def row(name: str, reached: bool = False) -> str:
        c = switch_call(name)
        names = c.reaches if reached else c.steps
        runs = ", ".join(f"`{s}` ({', '.join(str(a) for a in spec[s].actions)})" for s in names)
        return f"`{c.name}`, {'reaches ' if reached else ''}step{'s' if len(names) > 1 else ''} {runs}"

    does = {wake_call("weights"): _ENTER_DOES["weights"], WEIGHT_SYNC: _ENTER_DOES["sync"],
            wake_call("kv_cache"): _ENTER_DOES["kv_cache"]}
    enter = [
        "Training params on the device: without the switch loop (no actor attached) and with param_offload on, "
        "verl's load_megatron_model_to_gpu; under the loop they are there already.",
        "Plan, on the first switch only: every rank together builds the run's weight sync for "
        "recipe.reshard_method (direct or alltoallv; WeightSync.build) and checks its plan against both models' "
        "shapes and the experts' placement; it stays on the manager.",
        *(f"{row(c.name)}: {does[c.name]}" for c in calls_inside(SHARDING_ENTER, steps)),
        "Report: the switch's figures go into the manager's timing dict (verl_patches/reporting/switch_report.py): the "
        "reshard's bytes, the ledger's host-link bytes and peak, the self-check's figures, the captured-graph "
        "addresses audited, the device's watermarks per step.",
        "RNG: the generation's RNG state is swapped in, as upstream does.",
    ]
    upstream = [
        "verl's __enter__ as shipped: the training params come to the device when param_offload is on.",
        f"{row(wake_call('weights'), reached=True)}: as above.",
        "verl's weight sync, which the loop counts as its `reshard` step: per_tensor_generator (PP broadcast, "
        "TP all-gather, EP all-gather to full tensors, HF names) into vLLM's load_weights; then verl's "
        "offload_megatron_model_to_cpu when param_offload is on.",
        "Ours, when verl asks for the KV cache: MLA's post-load processing redone; then, if the training params "
        "are still on the device (under the switch loop, or param_offload off), the self-check against the "
        "direct method's plan. An engine whose wake_up takes no tags gets MLA's redo after verl's __enter__.",
        f"{row(wake_call('kv_cache'), reached=True)}: under the switch loop the steps before it run first "
        "(`offload_train_params`), then the KV cache is allocated.",
        "Report: the self-check's figures and the captured-graph addresses audited only.",
        "RNG: verl's swap.",
    ]
    leave = [
        f"{row('LLM.sleep')}: under the switch loop (patch vllm.llm.sleep_to_offload) the generation's step "
        "closes and the KV cache, then the rollout weights, are released, no copy to host; without it vLLM's "
        "sleep(level=1).",
        "verl's: the actor's modules back to train mode, empty_cache, the training RNG state restored.",
    ]
    return "\n".join([
        _numbered("__enter__, recipe.reshard_method direct (default) or alltoallv:", enter),
        _numbered("__enter__, recipe.reshard_method upstream (verl's own, for comparison):", upstream),
        _numbered("__exit__ (verl's, not wrapped):", leave),
    ])


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
        flag="actor_rollout_ref.rollout.recipe.reshard_method (direct | alltoallv | upstream), "
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
