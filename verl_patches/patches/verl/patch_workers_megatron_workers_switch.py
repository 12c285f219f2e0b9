"""Switch schedule, worker side (docs/RECIPE.md item 2, docs/DESIGN.md section 3), with recipe.offload (default on).
verl 0.4.1 offloads params *and* grads at the end of update_actor and its sharding manager loads both back
for the reshard (load_megatron_model_to_gpu(load_grad=True)), then offloads them again: the params cross
the link twice per step and the grads are allocated for nothing. Our order, on the offload engine
(verl_patches/offload/megatron_memory.py, one engine per process shared with the rollout's groups):
- init_model: verl's own param/grad/optimizer/ref offload flags are turned off (both would move the same
  tensors; verl's ref offload also replaces param.data under our groups); ActorMemory is attached as
  the sharding manager's stashed ``actor_memory`` (verl_patches/core/stash.py) and the iteration starts where an update ends; the reference model is
  copied to host once.
- update_actor: onload params, grads (zeroed: Megatron zeroes them before each backward) and optimizer
  first; at the end release the grads and offload the optimizer state (not with MindSpeed's swap optimizer,
  recipe.megatron.swap_optimizer with MindSpeed loaded, which moves its own); the params stay for the reshard.
- generate_sequences: nothing is reloaded; the sharding manager reshards from the resident params and
  then calls ``actor_memory.offload_params()`` (patch_workers_sharding_manager_megatron_vllm.py), before
  the KV cache is initialised. Both ends are checked here and are no-ops in that order: params missing at
  entry are onloaded (a reshard from freed storage would be garbage), params still resident at exit are
  offloaded.
- compute_ref_log_prob: onload the reference params, forward, offload (a free: the host copy is exact).
- compute_log_prob / save_checkpoint / load_checkpoint: what they read is onloaded and put back after.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

_W = "verl.workers.megatron_workers:ActorRolloutRefWorker."
_COMMON_OWN = dict(kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1")

# -- flags --------------------------------------------------------------------------------

OFFLOAD_FLAG = "actor_rollout_ref.rollout.recipe.offload"
SWAP_OPTIMIZER_FLAG = "actor_rollout_ref.rollout.recipe.megatron.swap_optimizer"
# verl's own offload switches, which the recipe's offload replaces.
VERL_OFFLOAD_ATTRS = ("_is_offload_param", "_is_offload_grad", "_is_offload_optimizer", "_ref_is_offload_param")


def offload_on(config: Any) -> bool:
    from verl_patches import settings

    return settings.from_worker(config, "offload")


def swap_optimizer_active(config: Any) -> bool:
    """MindSpeed's swap optimizer moves the optimizer state itself, so ours must not. It exists only
    where MindSpeed is loaded (by the end of init_model its adaptor has patched the model build);
    elsewhere the flag does nothing (patch_single_controller_base_megatron_worker.py reports it
    unused) and the optimizer state is ours to offload."""
    import sys

    from verl_patches import settings
    from verl_patches.megatron_args import parse

    section = settings.plain(settings.from_worker(config, "megatron"))
    return parse(section).swap_optimizer and "mindspeed" in sys.modules



# -- switch schedule ---------------------------------------------------------------------------

def _engine():
    from verl_patches.rollout.engine_memory import shared_offload_engine

    return shared_offload_engine()


def wrap_init_model_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_model(self):
        if not offload_on(self.config):
            return original(self)
        # Ours moves these tensors now: verl's own offload would move them a second time.
        for attr in VERL_OFFLOAD_ATTRS:
            setattr(self, attr, False)
        out = original(self)
        from verl_patches.offload.megatron_memory import ActorMemory, ReferenceMemory

        if self._is_actor:
            swap = swap_optimizer_active(self.config)
            actor = ActorMemory(self.actor_module, None if swap else self.actor_optimizer, engine=_engine())
            stash.put(self, "actor_memory", actor)
            sharding_manager = getattr(self, "sharding_manager", None)
            if sharding_manager is not None:
                stash.put(sharding_manager, "actor_memory", actor)
            # Every iteration starts where an update ends (docs/DESIGN.md section 3, step 1).
            actor.after_update()
        if self._is_ref:
            ref = ReferenceMemory(self.ref_module, engine=_engine())
            stash.put(self, "ref_memory", ref)
            ref.offload()
        _empty_cache()
        return out

    return init_model


def _empty_cache() -> None:
    from verl_patches import accelerator

    accelerator.empty_cache()


def wrap_update_actor_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_actor(self, data):
        memory = stash.get(self, "actor_memory")
        if memory is None:
            return original(self, data)
        memory.before_update()
        out = original(self, data)
        memory.after_update()
        _empty_cache()
        return out

    return update_actor


def wrap_generate_sequences_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate_sequences(self, prompts):
        memory = stash.get(self, "actor_memory")
        if memory is None:
            return original(self, prompts)
        memory.onload_params()  # a no-op after an update: the reshard reads the resident params
        out = original(self, prompts)
        memory.offload_params()  # a no-op when the sharding manager did it after the reshard
        return out

    return generate_sequences


def wrap_compute_log_prob_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compute_log_prob(self, data):
        memory = stash.get(self, "actor_memory")
        if memory is None:
            return original(self, data)
        from verl_patches.offload.groups import Location

        was_off = memory.params.location is not Location.DEVICE
        memory.onload_params()
        out = original(self, data)
        if was_off:
            memory.offload_params()
        return out

    return compute_log_prob


def wrap_compute_ref_log_prob_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compute_ref_log_prob(self, data):
        memory = stash.get(self, "ref_memory")
        if memory is None:
            return original(self, data)
        memory.onload()
        try:
            return original(self, data)
        finally:
            memory.offload()  # read-only: frees, the host copy is still exact

    return compute_ref_log_prob


def _wrap_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def checkpoint(self, *args, **kwargs):
        memory = stash.get(self, "actor_memory")
        if memory is None:
            return original(self, *args, **kwargs)
        from verl_patches.offload.groups import Location

        params_off = memory.params.location is not Location.DEVICE
        opt_off = memory.opt is not None and memory.opt.location is not Location.DEVICE
        memory.onload_params()
        memory.onload_optimizer()
        out = original(self, *args, **kwargs)
        if opt_off:
            memory.offload_optimizer()
        if params_off:
            memory.offload_params()
        return out

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
        flag=OFFLOAD_FLAG + ", " + SWAP_OPTIMIZER_FLAG,
        why="Builds the actor's params / grads / optimizer groups and the reference's group on the process's "
            "offload engine, hands the actor's to the sharding manager (which offloads the params right after the "
            "reshard), turns verl's own offload off so nothing moves twice, and starts at the end of an update.",
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
        flag=OFFLOAD_FLAG + ", " + SWAP_OPTIMIZER_FLAG,
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
        flag=OFFLOAD_FLAG,
        why="The params come in resident (nothing is reloaded) and leave offloaded: the sharding manager offloads "
            "them right after the reshard, before the KV cache is initialised; this checks both ends, and each "
            "is a no-op when the order held.",
        remove_when="verl's sharding manager offloads the training params after the reshard itself.",
        **_COMMON_OWN,
    ),
    Patch(
        feature="switch",
        id="verl.megatron_worker.log_prob_onload", after=("verl.tensor_cache.compute_log_prob",),
        target=_W + "compute_log_prob",
        fingerprint=Fingerprint(signature="def compute_log_prob(self, data: DataProto)", source_sha="46d3720f4e27860a"),
        replacement=f"{__name__}:wrap_compute_log_prob_offload",
        flag=OFFLOAD_FLAG,
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
        flag=OFFLOAD_FLAG,
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
