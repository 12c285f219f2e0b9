"""Switch schedule, worker side (docs/RECIPE.md item 2, docs/DESIGN.md section 3), with recipe.offload (default on).
verl 0.4.1 offloads params *and* grads at the end of update_actor and its sharding manager loads both back
for the reshard (load_megatron_model_to_gpu(load_grad=True)), then offloads them again: the params cross
the link twice per step and the grads are allocated for nothing. Ours is one loop, offload/schedule.py's
``our_steps()``, run on the live groups by verl_patches/offload/live.py; each wrapper here runs its row of
live.py's ``CALLS`` (the call -> step table, rendered in docs/DESIGN.md section 3):
- init_model: verl's own param/grad/optimizer/ref offload flags are turned off (both would move the same
  tensors; verl's ref offload also replaces param.data under our groups); ActorMemory and ReferenceMemory
  (offload/megatron_memory.py, on the switch loop's offload engine) are attached to the loop, which puts
  them where an update ends (grads released, optimizer state and reference on host); the actor's memory
  is stashed on the sharding manager (verl_patches/core/stash.py), which tells it to run under the loop.
- update_actor: the optimizer state is the loop's to move unless MindSpeed's swap optimizer
  (recipe.megatron.swap_optimizer with MindSpeed loaded) moves its own; the params stay on the device
  after the update, for the reshard.
- init_model, always: megatron-core's optimizer offload (actor.optim.optimizer_cpu_offload, patch
  verl.optim.cpu_offload) together with recipe.megatron.swap_optimizer is refused (OptimizerOffloadError).
  With the optimizer on the host the actor's optimizer group holds only what stays on the device (none at
  fraction 1.0), so the loop never moves the host copies.
- generate_sequences: the sharding manager and the engine's wake_up / sleep reach the rollout steps
  inside it; leaving, it reaches the segment's end, so a step nobody reached still runs, in order.
- compute_log_prob / save_checkpoint / load_checkpoint: excursions; what they read comes to the device
  and goes back where the loop had it.
- Profiles (recipe.profile, with or without the recipe's offload): the stage calls run inside their stage
  (verl_patches/base/profile.py): generate_sequences is ``rollout``, compute_log_prob ``old_log_prob``,
  compute_ref_log_prob ``ref_log_prob``, update_actor ``update``, for the trainer's global step that came with
  the batch (patch verl.self_check.step_to_workers); init_model configures the process's profiling.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.config import settings
from verl_patches.config.optim_offload import OptimizerOffloadError, offload_settings

_W = "verl.workers.megatron_workers:ActorRolloutRefWorker."
_COMMON_OWN = dict(kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1")

# -- flags --------------------------------------------------------------------------------

OFFLOAD_FLAG = "actor_rollout_ref.rollout.recipe.offload"
PROFILE_FLAG = "actor_rollout_ref.rollout.recipe.profile"
SWAP_OPTIMIZER_FLAG = "actor_rollout_ref.rollout.recipe.megatron.swap_optimizer"
# verl's own offload switches, which the recipe's offload replaces.
VERL_OFFLOAD_ATTRS = ("_is_offload_param", "_is_offload_grad", "_is_offload_optimizer", "_ref_is_offload_param")


def offload_on(config: Any) -> bool:
    return settings.from_worker(config).offload


def swap_optimizer_active(config: Any) -> bool:
    """MindSpeed's swap optimizer moves the optimizer state itself, so ours must not. It exists only
    where MindSpeed is loaded (by the end of init_model its adaptor has patched the model build);
    elsewhere the flag does nothing (patch_single_controller_base_megatron_worker.py reports it
    unused) and the optimizer state is ours to offload."""
    return settings.from_worker(config).megatron.swap_optimizer and "mindspeed" in sys.modules



# -- the switch loop ----------------------------------------------------------------------------
# Each wrapper runs its row of the call -> step table (verl_patches/offload/live.py:CALLS); the order
# itself is offload/schedule.py:our_steps.

def _switch():
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.offload.live import live_switch

    return live_switch()


def _row(method: str) -> str:
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.offload.live import WORKER

    return f"{WORKER}.{method}"


def _profiles():
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.base import profile

    return profile


def _step(data: Any) -> Any:
    """The trainer's global step that came with ``data`` (None for a validation generation, or none sent)."""
    meta = getattr(data, "meta_info", None) or {}
    step = meta.get(stash.STEP_META_KEY)
    return None if step is None or meta.get("validate") else int(step)


def _rank(worker: Any) -> int:
    rank = getattr(worker, "rank", None)
    if rank is None:
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
    return int(rank)


def check_optimizer_offload(config: Any) -> None:
    """megatron-core's optimizer offload (actor.optim.optimizer_cpu_offload, patch verl.optim.cpu_offload)
    and MindSpeed's swap optimizer (recipe.megatron.swap_optimizer) would both keep Adam's state on the
    host and move it each step, each behind the other's back: asking for both is refused by name, whether
    or not MindSpeed is loaded in this process."""
    optim = config.get("actor", {}).get("optim", None) if hasattr(config, "get") else None
    if optim is None or offload_settings(optim) is None:
        return
    if settings.from_worker(config).megatron.swap_optimizer:
        raise OptimizerOffloadError(
            "actor.optim.optimizer_cpu_offload=True (megatron-core's HybridDeviceOptimizer keeps the optimizer "
            f"state on the host) cannot combine with {SWAP_OPTIMIZER_FLAG}=True (MindSpeed's swap optimizer moves "
            "the same state itself): turn one of them off")


def wrap_init_model_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_model(self):
        _profiles().configure(settings.from_worker(self.config).profile, _rank(self))
        if getattr(self, "_is_actor", False):
            check_optimizer_offload(self.config)
        if not offload_on(self.config):
            return original(self)
        # Ours moves these tensors now: verl's own offload would move them a second time.
        for attr in VERL_OFFLOAD_ATTRS:
            setattr(self, attr, False)
        out = original(self)
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.offload.megatron_memory import ActorMemory, ReferenceMemory

        # Attached where the loop starts (an update's end): grads released, optimizer state on host,
        # the reference copied to host once.
        if self._is_actor:
            swap = swap_optimizer_active(self.config)
            actor = ActorMemory(self.actor_module, None if swap else self.actor_optimizer,
                                engine=_switch().offload_engine())
            stash.put(self, "actor_memory", actor)
            sharding_manager = getattr(self, "sharding_manager", None)
            if sharding_manager is not None:
                stash.put(sharding_manager, "actor_memory", actor)
            _switch().attach(actor)
        if self._is_ref:
            ref = ReferenceMemory(self.ref_module, engine=_switch().offload_engine())
            stash.put(self, "ref_memory", ref)
            _switch().attach(ref)
        _empty_cache()
        return out

    return init_model


def _empty_cache() -> None:
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.base import accelerator

    accelerator.empty_cache()


def wrap_update_actor_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_actor(self, data):
        with _profiles().stage("update", _step(data)):
            if stash.get(self, "actor_memory") is None:
                return original(self, data)
            out = _switch().run_call(_row("update_actor"), lambda: original(self, data))
            _empty_cache()
            return out

    return update_actor


def wrap_generate_sequences_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate_sequences(self, prompts):
        with _profiles().stage("rollout", _step(prompts)):
            if stash.get(self, "actor_memory") is None:
                return original(self, prompts)
            switch = _switch()
            switch.run_call(_row("generate_sequences, entering"))
            out = original(self, prompts)
            # Nothing left to do when the sharding manager and the engine's sleep reached every step.
            switch.run_call(_row("generate_sequences, leaving"))
            return out

    return generate_sequences


def wrap_compute_log_prob_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compute_log_prob(self, data):
        with _profiles().stage("old_log_prob", _step(data)):
            if stash.get(self, "actor_memory") is None:
                return original(self, data)
            return _switch().run_call(_row("compute_log_prob"), lambda: original(self, data))

    return compute_log_prob


def wrap_compute_ref_log_prob_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compute_ref_log_prob(self, data):
        with _profiles().stage("ref_log_prob", _step(data)):
            if stash.get(self, "ref_memory") is None:
                return original(self, data)
            # ref_offload only frees: the reference is read-only, its host copy still exact.
            return _switch().run_call(_row("compute_ref_log_prob"), lambda: original(self, data))

    return compute_ref_log_prob


def _wrap_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def checkpoint(self, *args, **kwargs):
        if stash.get(self, "actor_memory") is None:
            return original(self, *args, **kwargs)
        return _switch().run_call(_row(original.__name__), lambda: original(self, *args, **kwargs))

    return checkpoint


wrap_save_checkpoint = _wrap_checkpoint
wrap_load_checkpoint = _wrap_checkpoint


PATCHES = [
    Patch(
        feature="switch",
        id="verl.megatron_worker.offload_init", after=("verl.megatron_worker.ref_shares_actor_groups",),
        target=_W + "init_model",
        fingerprint=Fingerprint(signature="def init_model(self)", source_sha="b43dfa697a54895c"),
        replacement=f"{__name__}:wrap_init_model_offload",
        flag=OFFLOAD_FLAG + ", " + SWAP_OPTIMIZER_FLAG + ", actor_rollout_ref.actor.optim.optimizer_cpu_offload, "
        + PROFILE_FLAG,
        why="Builds the actor's params / grads / optimizer groups and the reference's group on the process's "
            "offload engine and attaches them to the switch loop where an update ends; hands the actor's to the "
            "sharding manager (which then reshards under the loop); turns verl's own offload off so nothing "
            "moves twice.",
        remove_when="verl's Megatron worker offloads grads only after the update and lets the sharding manager "
                    "offload params after the reshard (docs/DESIGN.md section 3).",
        **_COMMON_OWN,
    ),
    Patch(
        feature="switch",
        id="verl.megatron_worker.update_offload", after=("verl.tensor_cache.update_actor",),
        target=_W + "update_actor",
        fingerprint=Fingerprint(signature="def update_actor(self, data: DataProto)", source_sha="f8b46c040fd851f0"),
        replacement=f"{__name__}:wrap_update_actor_offload",
        flag=OFFLOAD_FLAG + ", " + SWAP_OPTIMIZER_FLAG + ", " + PROFILE_FLAG,
        why="Upstream offloads params and grads after the update and reloads both for the reshard. We onload "
            "params, grads and optimizer state before the update and afterwards release the grads and offload "
            "the optimizer state only: the params stay on device because the reshard reads them next.",
        remove_when="verl offloads grads only at the end of the update.",
        **_COMMON_OWN,
    ),
    Patch(
        feature="switch",
        id="verl.megatron_worker.generate_offload", after=("verl.tensor_cache.generate",),
        target=_W + "generate_sequences",
        fingerprint=Fingerprint(signature="def generate_sequences(self, prompts: DataProto)", source_sha="9f3b8f496926ac8f"),
        replacement=f"{__name__}:wrap_generate_sequences_offload",
        flag=OFFLOAD_FLAG + ", " + PROFILE_FLAG,
        why="The params come in resident (nothing is reloaded) and leave offloaded: the sharding manager reaches "
            "the loop's offload_train_params right after the reshard, before the KV cache is initialised; this "
            "begins the rollout segment and, leaving, reaches its end, running any step nobody reached.",
        remove_when="verl's sharding manager offloads the training params after the reshard itself.",
        **_COMMON_OWN,
    ),
    Patch(
        feature="switch",
        id="verl.megatron_worker.log_prob_onload", after=("verl.tensor_cache.compute_log_prob",),
        target=_W + "compute_log_prob",
        fingerprint=Fingerprint(signature="def compute_log_prob(self, data: DataProto)", source_sha="46d3720f4e27860a"),
        replacement=f"{__name__}:wrap_compute_log_prob_offload",
        flag=OFFLOAD_FLAG + ", " + PROFILE_FLAG,
        why="With recompute_old_log_prob on, the old log-prob forward runs after generation, when the params "
            "are on host: onload them (no grads) and put them back.",
        remove_when="verl's offload moves params only (as above).",
        **_COMMON_OWN,
    ),
    Patch(
        feature="switch",
        id="verl.megatron_worker.ref_offload", after=("verl.tensor_cache.compute_ref_log_prob",),
        target=_W + "compute_ref_log_prob",
        fingerprint=Fingerprint(signature="def compute_ref_log_prob(self, data: DataProto)", source_sha="410e0c571e22e384"),
        replacement=f"{__name__}:wrap_compute_ref_log_prob_offload",
        flag=OFFLOAD_FLAG + ", " + PROFILE_FLAG,
        why="Upstream copies the reference params back to host after every forward (param.data.to('cpu')). They "
            "never change: copied once at init, each later offload only frees them.",
        remove_when="verl offloads the reference without a copy when the host copy is current.",
        **_COMMON_OWN,
    ),
    Patch(
        feature="switch",
        id="verl.megatron_worker.save_checkpoint_onload",
        target=_W + "save_checkpoint",
        fingerprint=Fingerprint(signature="def save_checkpoint(self, checkpoint_path, hdfs_path=None, global_step=0, "
                                          "max_ckpt_to_keep=None)", source_sha="e3c3ea587fd6141e"),
        replacement=f"{__name__}:wrap_save_checkpoint",
        flag=OFFLOAD_FLAG,
        why="Checkpoints are saved after an update, when the optimizer state is on host: onload what the "
            "checkpoint reads and put it back.",
        remove_when="verl's checkpoint paths onload what its offload moved.",
        **_COMMON_OWN,
    ),
    Patch(
        feature="switch",
        id="verl.megatron_worker.load_checkpoint_onload",
        target=_W + "load_checkpoint",
        fingerprint=Fingerprint(signature="def load_checkpoint(self, checkpoint_path, hdfs_path=None, "
                                          "del_local_after_load=True)", source_sha="34a4720a7cba80e9"),
        replacement=f"{__name__}:wrap_load_checkpoint",
        flag=OFFLOAD_FLAG,
        why="Resuming writes params and optimizer state, which are on host after init_model: onload them first.",
        remove_when="verl's checkpoint paths onload what its offload moved.",
        **_COMMON_OWN,
    ),
]
