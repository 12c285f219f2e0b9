"""TensorCache, worker side: ActorRolloutRefWorker keeps each stage's device tensors in the
process's cache and takes from the driver only the row ids and what the host computed.

Upstream: verl/workers/megatron_workers.py. generate_sequences (DP_COMPUTE_PROTO: rank r gets chunk r),
compute_log_prob and compute_ref_log_prob (MEGATRON_COMPUTE_PROTO: every rank of data-parallel rank g
gets chunk g) and update_actor receive whole batches from the driver and return theirs to it.
We wrap the four methods; each acts only when the driver's request (meta_info[META_KEY], set by
patch_trainer_ppo_ray_trainer.py) is present, so a driver without the cache gets upstream behaviour.
- generate_sequences: caches every output tensor (rows = this rank's generation chunk) and returns
  only the host keys. The original copies its output to host before returning; we move the cached
  part back (a local copy of a few MB per rank) rather than patch the rollout itself.
- the next stage: one all_to_all moves the cache to the rows the dispatcher gave this rank (the
  Megatron DP layout, in the driver's current order); later stages with the same rows move nothing.
  Their outputs (old_log_probs, ref_log_prob) are cached; update_actor empties the cache.
Decorators (@register dispatch mode) survive: functools.wraps copies the function's attributes.

Switch schedule, worker side (docs/RECIPE.md item 2, docs/DESIGN.md section 3), with recipe.offload (default on).
verl 0.4.1 offloads params *and* grads at the end of update_actor and its sharding manager loads both back
for the reshard (load_megatron_model_to_gpu(load_grad=True)), then offloads them again: the params cross
the link twice per step and the grads are allocated for nothing. Our order, on the offload engine
(verl_patches/offload/megatron_memory.py, one engine per process shared with the rollout's groups):
- init_model: verl's own param/grad/optimizer/ref offload flags are turned off (both would move the same
  tensors; verl's ref offload also replaces param.data under our groups); ActorMemory is attached as
  ``sharding_manager.actor_memory`` and the iteration starts where an update ends; the reference model is
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

The reference shares the actor's process group. verl's trainer builds the Megatron reference as its own
worker (role "ref") in the actor's process (create_colocated_worker_cls); its constructor sees
torch.distributed initialised by the actor worker and skips initialize_model_parallel, so the model is
built with the actor's groups and ``ref.megatron``'s layout keys are silently ignored. We check they agree
with the process's groups and name each that differs. Role "actor_rollout_ref" does not build in 0.4.1
(init_model's reference branch gets the actor's 5-tuple from _build_model_optimizer, and
``_ref_is_offload_param`` is set only in an elif that role skips): we refuse it with that explanation.
Left as upstream has it: with random init (load_weight=False) the reference is not a copy of the actor.
Both constructors seed the same RNGs, then the trainer builds the reference first, so the actor's init
draws from a later RNG state (the KL starts above zero; throughput is unaffected).

torch.compile for the rollout only (docs/RECIPE.md item 7). MindSpeed's features manager registers
``torch.compile`` -> ``torch.jit.script`` in RequirementsBasicFeature.te_adaptation
(mindspeed/features_manager/megatron_basic/requirements_basic.py at the lock's release
v2.1.0_core_r0.12.1; tests/patches/mindspeed/test_mindspeed_release.py reads it from the installed
release). MindSpeed's patch manager also rebinds module aliases of the original; vLLM and vLLM-Ascend
call torch.compile by attribute, so only that is swapped. vLLM compiles while the engine is built (_build_rollout)
and vLLM-Ascend compiles TorchAir graphs lazily per batch size while generating, so both run inside
verl_patches.compile_context.real_torch_compile (the real function, saved by the prelude before MindSpeed's
adaptor is imported), which puts MindSpeed's object back on exit.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.tensor_cache.protocol import META_KEY, ROW_KEY

logger = logging.getLogger(__name__)
FLAG = "actor_rollout_ref.rollout.recipe.tensor_cache (read by the driver, which marks its requests)"


def _device():
    from verl_patches import accelerator

    return accelerator.current_device()


def wrap_generate_sequences(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate_sequences(self, prompts):
        request = prompts.meta_info.pop(META_KEY, None)
        if request is None:
            return original(self, prompts)
        import torch
        import torch.distributed as dist

        from verl.protocol import DataProto

        from verl_patches.tensor_cache import process_cache

        out = original(self, prompts)
        cache = process_cache()
        cache.begin(request["step"])
        # DP_COMPUTE_PROTO gives rank r the r-th of world equal chunks (DataProto.chunk refuses others).
        rank, n = dist.get_rank(), len(out)
        device = _device()
        cache.put({k: out.batch[k].to(device) for k in out.batch.keys()},
                  torch.arange(rank * n, (rank + 1) * n, dtype=torch.int64))
        host = [k for k in request["host_keys"] if k in out.batch.keys()]
        reply = DataProto(batch=out.batch.select(*host), non_tensor_batch=out.non_tensor_batch, meta_info=out.meta_info)
        reply.meta_info[META_KEY] = {"cached": cache.names()}
        return reply

    return generate_sequences


def _wrap_stage(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def stage(self, data):
            request = data.meta_info.pop(META_KEY, None)
            if request is None:
                return original(self, data)
            from verl.protocol import DataProto

            from verl_patches.tensor_cache import process_cache

            cache = process_cache()
            cache.check_step(request["step"])
            rows = data.batch[ROW_KEY].cpu()
            cache.relayout(rows, unchanged=request["unchanged"])
            device = _device()
            tensors = dict(cache.get(request["from_cache"]))
            tensors.update({k: data.batch[k].to(device) for k in data.batch.keys() if k != ROW_KEY})
            full = DataProto.from_dict(tensors=tensors, non_tensors=dict(data.non_tensor_batch),
                                       meta_info=data.meta_info)
            out = original(self, full)
            if op == "update_actor":
                cache.clear()
            else:
                keep = [k for k in request["cache"] if k in out.batch.keys()]
                cache.put({k: out.batch[k].to(device) for k in keep}, rows)
                returned = [k for k in request["return"] if k in out.batch.keys()]
                # No batch at all when nothing goes back: an empty TensorDict cannot be pickled
                # (DataProto.__getstate__ consolidates it); the driver restores the row count.
                out = DataProto(batch=out.batch.select(*returned) if returned else None,
                                non_tensor_batch=out.non_tensor_batch, meta_info=out.meta_info)
            out.meta_info[META_KEY] = {"cached": cache.names()}
            return out

        return stage

    return factory


wrap_compute_log_prob = _wrap_stage("compute_log_prob")
wrap_compute_ref_log_prob = _wrap_stage("compute_ref_log_prob")
wrap_update_actor = _wrap_stage("update_actor")



# -- recipe flags --------------------------------------------------------------------------------

OFFLOAD_FLAG = "actor_rollout_ref.rollout.recipe.offload"
SWAP_OPTIMIZER_FLAG = "actor_rollout_ref.rollout.recipe.megatron.swap_optimizer"
COMPILE_FLAG = "actor_rollout_ref.rollout.recipe.rollout_torch_compile"
# verl's own offload switches, which the recipe's offload replaces.
VERL_OFFLOAD_ATTRS = ("_is_offload_param", "_is_offload_grad", "_is_offload_optimizer", "_ref_is_offload_param")


def offload_on(config: Any) -> bool:
    from verl_patches import settings

    return settings.from_worker(config, "offload")


def rollout_compile_on(config: Any) -> bool:
    from verl_patches import settings

    return settings.from_worker(config, "rollout_torch_compile")


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


# -- the reference in the actor's process ------------------------------------------------------

# ref.megatron key -> megatron.core.parallel_state getter of the size the process was initialised with
LAYOUT_KEYS = {
    "tensor_model_parallel_size": "get_tensor_model_parallel_world_size",
    "pipeline_model_parallel_size": "get_pipeline_model_parallel_world_size",
    "virtual_pipeline_model_parallel_size": "get_virtual_pipeline_model_parallel_world_size",
    "context_parallel_size": "get_context_parallel_world_size",
    "expert_model_parallel_size": "get_expert_model_parallel_world_size",
    "expert_tensor_parallel_size": "get_expert_tensor_parallel_world_size",
}


def layout_mismatches(configured: Any, actual: dict) -> list[str]:
    """Keys of ``configured`` (ref.megatron) that differ from the process's groups. Unset (None)
    expert TP means TP, unset VPP means none, as megatron-core reads them."""
    out = []
    for key, have in actual.items():
        want = configured.get(key, None) if hasattr(configured, "get") else None
        if want is None and key == "expert_tensor_parallel_size":
            want = actual["tensor_model_parallel_size"]
        if key == "virtual_pipeline_model_parallel_size" and want in (None, 1) and have in (None, 1):
            continue
        if want is not None and want != have:
            out.append(f"ref.megatron.{key}={want} but the process's groups have {have}")
    return out


def _process_layout() -> dict:
    from megatron.core import parallel_state as mpu

    return {k: getattr(mpu, getter)() for k, getter in LAYOUT_KEYS.items()}


def wrap_init_model_shared_groups(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_model(self):
        if self._is_ref and self._is_actor:
            raise ValueError(
                f"role {self.role!r}: verl 0.4.1's Megatron ActorRolloutRefWorker cannot hold the reference in the "
                "actor's worker (init_model's reference branch receives the actor's model and optimizer from "
                "_build_model_optimizer, and _ref_is_offload_param is never set for this role); use the colocated "
                "'actor_rollout' and 'ref' workers, as verl's trainer does")
        if self._is_ref:
            bad = layout_mismatches(self.config.ref.megatron, _process_layout())
            if bad:
                raise ValueError("the reference shares the actor's process group (its worker skips "
                                 "initialize_model_parallel), so its layout must be the actor's: " + "; ".join(bad))
        return original(self)

    return init_model


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
            self.actor_memory = ActorMemory(self.actor_module, None if swap else self.actor_optimizer,
                                            engine=_engine())
            sharding_manager = getattr(self, "sharding_manager", None)
            if sharding_manager is not None:
                sharding_manager.actor_memory = self.actor_memory
            # Every iteration starts where an update ends (docs/DESIGN.md section 3, step 1).
            self.actor_memory.after_update()
        if self._is_ref:
            self.ref_memory = ReferenceMemory(self.ref_module, engine=_engine())
            self.ref_memory.offload()
        _empty_cache()
        return out

    return init_model


def _empty_cache() -> None:
    from verl_patches import accelerator

    accelerator.empty_cache()


def wrap_update_actor_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_actor(self, data):
        memory = getattr(self, "actor_memory", None)
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
        memory = getattr(self, "actor_memory", None)
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
        memory = getattr(self, "actor_memory", None)
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
        memory = getattr(self, "ref_memory", None)
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
        memory = getattr(self, "actor_memory", None)
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

# Generation's random stream, saved beside the actor's checkpoint (one file per rank). verl's sharding
# manager gives vLLM's sampling its own generator state per data-parallel group (gen_random_states,
# swapped in around every generation); verl's checkpoint keeps the training RNGs but not that one, so a
# resumed run would sample from the initial state again and leave the uninterrupted run's path.
ROLLOUT_RNG_DIR = "rollout_rng"


def _rollout_rng_file(checkpoint_path: str):
    from pathlib import Path

    import torch.distributed as dist

    return Path(checkpoint_path) / ROLLOUT_RNG_DIR / f"rank_{dist.get_rank()}.pt"


def wrap_save_checkpoint_rollout_rng(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_checkpoint(self, checkpoint_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        out = original(self, checkpoint_path, hdfs_path, global_step, max_ckpt_to_keep)
        state = getattr(getattr(self, "sharding_manager", None), "gen_random_states", None)
        if state is not None and checkpoint_path:
            import torch

            from verl_patches.atomic import atomic_path

            path = _rollout_rng_file(checkpoint_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                torch.save({"gen_random_states": state}, tmp)
        return out

    return save_checkpoint


def wrap_load_checkpoint_rollout_rng(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_checkpoint(self, checkpoint_path, hdfs_path=None, del_local_after_load=True):
        manager = getattr(self, "sharding_manager", None)
        saved = None
        if manager is not None and checkpoint_path:
            import torch

            path = _rollout_rng_file(checkpoint_path)
            # Read first: the load may delete the local copy.
            saved = torch.load(path, weights_only=True) if path.is_file() else None
            if saved is None:
                logger.warning("%s has no %s: generation resumes from its initial random state, so samples "
                               "differ from an uninterrupted run's", checkpoint_path, ROLLOUT_RNG_DIR)
        out = original(self, checkpoint_path, hdfs_path, del_local_after_load)
        if saved is not None:
            manager.gen_random_states = saved["gen_random_states"]
        return out

    return load_checkpoint


# -- torch.compile for the rollout only ------------------------------------------------------------

def _wrap_compiled(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compiled(self, *args, **kwargs):
        from verl_patches.compile_context import real_torch_compile

        with real_torch_compile(enabled=rollout_compile_on(self.config)):
            return original(self, *args, **kwargs)

    return compiled


wrap_build_rollout_compile = _wrap_compiled
wrap_generate_sequences_compile = _wrap_compiled


_COMMON = dict(kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1", flag=FLAG,
               remove_when="verl keeps stage outputs on the workers between stages (see verl.tensor_cache.driver).")
_W = "verl.workers.megatron_workers:ActorRolloutRefWorker."
_COMMON_OWN = dict(kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1")

PATCHES = [
    Patch(
        feature="tensor_cache",
        id="verl.tensor_cache.generate",
        target=_W + "generate_sequences",
        fingerprint=Fingerprint(signature="def generate_sequences(self, prompts: DataProto)", source_sha="9f3b8f496926ac8f"),
        replacement=f"{__name__}:wrap_generate_sequences",
        why="The rollout's input_ids, position_ids and responses are what the next stages feed the model; "
            "upstream returns all of them to the driver, which sends them back twice. They stay on the device.",
        **_COMMON,
    ),
    Patch(
        feature="tensor_cache",
        id="verl.tensor_cache.compute_log_prob",
        target=_W + "compute_log_prob",
        fingerprint=Fingerprint(signature="def compute_log_prob(self, data: DataProto)", source_sha="46d3720f4e27860a"),
        replacement=f"{__name__}:wrap_compute_log_prob",
        why="With the cache the driver sends row ids only; the worker rebuilds the batch from the cache (one "
            "all-to-all from the generation layout) and keeps old_log_probs on the device for the update.",
        **_COMMON,
    ),
    Patch(
        feature="tensor_cache",
        id="verl.tensor_cache.compute_ref_log_prob",
        target=_W + "compute_ref_log_prob",
        fingerprint=Fingerprint(signature="def compute_ref_log_prob(self, data: DataProto)", source_sha="410e0c571e22e384"),
        replacement=f"{__name__}:wrap_compute_ref_log_prob",
        why="As compute_log_prob: inputs from the cache, ref_log_prob kept on the device for the KL loss of the update.",
        **_COMMON,
    ),
    Patch(
        feature="tensor_cache",
        id="verl.tensor_cache.update_actor",
        target=_W + "update_actor",
        fingerprint=Fingerprint(signature="def update_actor(self, data: DataProto)", source_sha="f8b46c040fd851f0"),
        replacement=f"{__name__}:wrap_update_actor",
        why="The update needs the cached model inputs and log-probs plus the advantages the host computed; only "
            "the advantages (and row ids) travel from the driver. The step's cache is freed afterwards.",
        **_COMMON,
    ),
    Patch(
        feature="model_layout",
        id="verl.megatron_worker.ref_shares_actor_groups",
        target=_W + "init_model",
        fingerprint=Fingerprint(signature="def init_model(self)", source_sha="b43dfa697a54895c"),
        replacement=f"{__name__}:wrap_init_model_shared_groups",
        flag="always on (checks only): actor_rollout_ref.ref.megatron.{tensor,pipeline,virtual_pipeline,context,"
             "expert,expert_tensor}_model_parallel_size",
        why="The colocated reference worker skips initialize_model_parallel (the actor's worker did it in the same "
            "process) and builds its model with the actor's groups, silently ignoring ref.megatron's layout; a "
            "different layout would load a checkpoint into the wrong shards. Each differing key is named. Role "
            "actor_rollout_ref cannot build in 0.4.1 and is refused with the reason instead of an unpack error.",
        remove_when="verl's Megatron worker checks the reference layout against the shared groups (or derives it "
                    "from the actor's) and builds role actor_rollout_ref.",
        **_COMMON_OWN,
    ),
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
    Patch(
        feature="checkpoint",
        id="verl.megatron_worker.rollout_rng_save", after=("verl.megatron_worker.save_checkpoint_onload",),
        target=_W + "save_checkpoint",
        fingerprint=Fingerprint(signature="def save_checkpoint(self, checkpoint_path, hdfs_path=None, global_step=0, "
                                          "max_ckpt_to_keep=None)", source_sha="e3c3ea587fd6141e"),
        replacement=f"{__name__}:wrap_save_checkpoint_rollout_rng",
        flag="always on (a checkpoint of an actor with a rollout)",
        why="A resumed run must continue the run it resumes: verl saves the training RNGs but not the generator "
            "state its sharding manager keeps for generation, so the samples after a resume would differ.",
        remove_when="verl's checkpoint manager saves the rollout's generator state.",
        **_COMMON_OWN,
    ),
    Patch(
        feature="checkpoint",
        id="verl.megatron_worker.rollout_rng_load", requires=("verl.megatron_worker.rollout_rng_save",), after=("verl.megatron_worker.load_checkpoint_onload",),
        target=_W + "load_checkpoint",
        fingerprint=Fingerprint(signature="def load_checkpoint(self, checkpoint_path, hdfs_path=None, "
                                          "del_local_after_load=True)", source_sha="34a4720a7cba80e9"),
        replacement=f"{__name__}:wrap_load_checkpoint_rollout_rng",
        flag="always on (a checkpoint of an actor with a rollout)",
        why="Restores the generator state saved by verl.megatron_worker.rollout_rng_save, so generation after a "
            "resume samples what the uninterrupted run sampled.",
        remove_when="verl's checkpoint manager restores the rollout's generator state.",
        **_COMMON_OWN,
    ),
    Patch(
        feature="rollout_engine",
        id="verl.megatron_worker.build_rollout_compile",
        target=_W + "_build_rollout",
        fingerprint=Fingerprint(signature="def _build_rollout(self, trust_remote_code=False)", source_sha="b1844e84e961641b"),
        replacement=f"{__name__}:wrap_build_rollout_compile",
        flag=COMPILE_FLAG,
        why="MindSpeed replaces torch.compile with a call-through for training; vLLM compiles its model while the "
            "engine is built. The real torch.compile (saved by the prelude) is put in for the build and "
            "MindSpeed's put back after.",
        remove_when="MindSpeed scopes its torch.compile replacement to training, or the rollout runs in its own process.",
        **_COMMON_OWN,
    ),
    Patch(
        feature="rollout_engine",
        id="verl.megatron_worker.generate_compile", after=("verl.tensor_cache.generate", "verl.megatron_worker.generate_offload"),
        target=_W + "generate_sequences",
        fingerprint=Fingerprint(signature="def generate_sequences(self, prompts: DataProto)", source_sha="9f3b8f496926ac8f"),
        replacement=f"{__name__}:wrap_generate_sequences_compile",
        flag=COMPILE_FLAG,
        why="vLLM-Ascend compiles TorchAir graphs lazily per batch size during generation "
            "(NPUModelRunner._get_torchair_lazy_compiled_model); generation gets the real torch.compile too.",
        remove_when="MindSpeed scopes its torch.compile replacement to training, or the rollout runs in its own process.",
        **_COMMON_OWN,
    ),
]
