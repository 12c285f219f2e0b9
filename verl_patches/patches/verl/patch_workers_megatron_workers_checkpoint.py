"""Generation's random stream, saved beside the actor's checkpoint (one file per rank). verl's sharding
manager gives vLLM's sampling its own generator state per data-parallel group (gen_random_states,
swapped in around every generation); verl's checkpoint keeps the training RNGs but not that one, so a
resumed run would sample from the initial state again and leave the uninterrupted run's path.
Upstream: verl/workers/megatron_workers.py, ActorRolloutRefWorker.save_checkpoint / load_checkpoint.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.base.atomic import atomic_path

_W = "verl.workers.megatron_workers:ActorRolloutRefWorker."
_COMMON_OWN = dict(kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1")

logger = logging.getLogger(__name__)
ROLLOUT_RNG_DIR = "rollout_rng"


def _rollout_rng_file(checkpoint_path: str):
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch.distributed as dist

    return Path(checkpoint_path) / ROLLOUT_RNG_DIR / f"rank_{dist.get_rank()}.pt"


def wrap_save_checkpoint_rollout_rng(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_checkpoint(self, checkpoint_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        out = original(self, checkpoint_path, hdfs_path, global_step, max_ckpt_to_keep)
        state = getattr(getattr(self, "sharding_manager", None), "gen_random_states", None)
        if state is not None and checkpoint_path:
            # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
            # when the patch runs.
            import torch

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
            # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
            # when the patch runs.
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


PATCHES = [
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
        id="verl.megatron_worker.rollout_rng_load", requires=("verl.megatron_worker.rollout_rng_save",),
        after=("verl.megatron_worker.load_checkpoint_onload",),
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
]
