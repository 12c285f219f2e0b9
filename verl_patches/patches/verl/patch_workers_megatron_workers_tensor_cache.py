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
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.tensor_cache.protocol import META_KEY, ROW_KEY

_W = "verl.workers.megatron_workers:ActorRolloutRefWorker."

FLAG = "actor_rollout_ref.rollout.recipe.tensor_cache (read by the driver, which marks its requests)"


def _device():
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from verl_patches.base import accelerator

    return accelerator.current_device()


def wrap_generate_sequences(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate_sequences(self, prompts):
        request = prompts.meta_info.pop(META_KEY, None)
        if request is None:
            return original(self, prompts)
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
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
            # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
            # when the patch runs.
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


_COMMON = dict(kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1", flag=FLAG,
               remove_when="verl keeps stage outputs on the workers between stages (see verl.tensor_cache.driver).")

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
]
