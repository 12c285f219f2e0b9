"""Checkpoints that are whole or absent (issue 36): the driver's save commits a step only after every
rank's save returned, with a marker and an atomic tracker, and the resume takes only a whole step.

Upstream: verl/trainer/ppo/ray_trainer.py, RayPPOTrainer._save_checkpoint and _load_checkpoint. verl 0.4.1's
save lets each rank's checkpoint manager delete the oldest checkpoint before writing the new one
(max_actor_ckpt_to_keep), writes the tracker with a plain open and write, and its resume takes the
tracker's directory as it finds it; a node lost during a save could leave no whole checkpoint, or one
the resume takes although a rank's shards are missing. The order and the checks are in
verl_patches/train/checkpoint_commit.py; these replacements call the worker groups as verl's do.
"""

from __future__ import annotations

import os
from typing import Any

from verl_patches.base.atomic import atomic_path
from verl_patches.config import settings
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.train import checkpoint_commit as cc

_T = "verl.trainer.ppo.ray_trainer:RayPPOTrainer."
ASYNC_KEYS = ("actor_rollout_ref.actor.checkpoint.async_save", "critic.checkpoint.async_save")


def _select(config: Any, key: str, default: Any = None) -> Any:
    value = settings.select(config, key)  # the one reader of a composed config's key
    return default if value is None else value


def _root(config: Any) -> str:
    root = config.trainer.default_local_dir
    return root if os.path.isabs(root) else os.path.join(os.getcwd(), root)


def _max_to_keep(config: Any) -> int | None:
    if _select(config, "trainer.remove_previous_ckpt_in_save", False):
        return 1
    return _select(config, "trainer.max_actor_ckpt_to_keep", None)


def check_save_config(trainer: Any) -> None:
    """An asynchronous save returns before its files are written: the marker would be written over a partial
    directory. Refused, naming the key."""
    keys = [ASYNC_KEYS[0]] + ([ASYNC_KEYS[1]] if trainer.use_critic else [])
    on = [k for k in keys if _select(trainer.config, k, False)]
    if on:
        raise cc.CheckpointError(f"{', '.join(k + '=True' for k in on)}: {cc.ASYNC_SAVE_WHY}")


def save_checkpoint(self) -> None:
    """Replaces RayPPOTrainer._save_checkpoint: step directory, every rank's save, data.pt, then the commit."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch

    check_save_config(self)
    config, step = self.config, self.global_steps
    root = _root(config)
    directory = cc.prepare(root, step)
    print(f"checkpoint: saving step {step} to {directory}", flush=True)
    hdfs = config.trainer.get("default_hdfs_dir", None)

    def remote(role: str) -> str | None:
        return None if hdfs is None else os.path.join(hdfs, cc.STEP_DIR.format(step), role)

    # Every rank returns before the call does (a rank that fails, or whose node is lost, raises here), and no
    # rank deletes an older checkpoint: the commit does, after the tracker names this one.
    self.actor_rollout_wg.save_checkpoint(str(directory / "actor"), remote("actor"), step, max_ckpt_to_keep=None)
    if self.use_critic:
        self.critic_wg.save_checkpoint(str(directory / "critic"), remote("critic"), step, max_ckpt_to_keep=None)
    with atomic_path(directory / "data.pt") as tmp:
        torch.save(self.train_dataloader.state_dict(), tmp)
    removed = cc.commit(root, step, _max_to_keep(config))
    print(f"checkpoint: step {step} whole ({cc.COMMIT_MARKER}, tracker {cc.TRACKER})"
          + (f"; removed steps {removed} (max_actor_ckpt_to_keep)" if removed else ""), flush=True)


def load_checkpoint(self) -> int:
    """Replaces RayPPOTrainer._load_checkpoint: resume only from a whole checkpoint."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch

    config = self.config
    if (_select(config, "trainer.save_freq", -1) or -1) > 0:
        check_save_config(self)  # before the first step, not at the first save
    mode = config.trainer.resume_mode
    if mode == "disable":
        return 0
    if config.trainer.get("default_hdfs_dir", None) is not None:
        raise NotImplementedError("trainer.default_hdfs_dir is set: resuming from HDFS is not implemented "
                                  "(neither in verl 0.4.1)")
    if mode == "auto":
        point = cc.resume_dir(_root(config))
        for note in point.notes:
            print(f"checkpoint: {note}", flush=True)
        if point.directory is None:
            print("checkpoint: no whole checkpoint: training from scratch", flush=True)
            return 0
        step, directory = point.step, str(point.directory)
    elif mode == "resume_path":
        named = config.trainer.get("resume_from_path", None)
        problem = cc.resume_path_problem(named)
        if problem:
            raise cc.CheckpointError(problem)
        directory = named if os.path.isabs(named) else os.path.join(os.getcwd(), named)
        step = cc.check_named(directory)
    else:
        raise cc.CheckpointError(f"trainer.resume_mode={mode!r}: one of {', '.join(cc.RESUME_MODES)}")
    print(f"checkpoint: resuming from step {step}, {directory} (whole)", flush=True)
    self.global_steps = step
    drop = config.trainer.del_local_ckpt_after_load
    self.actor_rollout_wg.load_checkpoint(os.path.join(directory, "actor"), del_local_after_load=drop)
    if self.use_critic:
        self.critic_wg.load_checkpoint(os.path.join(directory, "critic"), del_local_after_load=drop)
    self.train_dataloader.load_state_dict(torch.load(os.path.join(directory, "data.pt"), weights_only=False))
    return step


_COMMON = dict(feature="checkpoint", kind="replace", phases=("driver",), upstream="verl", versions="==0.4.1",
               flag="always on (trainer.save_freq > 0 saves; trainer.resume_mode reads)")

PATCHES = [
    Patch(
        id="verl.ray_trainer.checkpoint_commit",
        target=_T + "_save_checkpoint",
        fingerprint=Fingerprint(signature="def _save_checkpoint(self)", source_sha="b48ba178fd9e35c4"),
        replacement=f"{__name__}:save_checkpoint",
        why="A checkpoint must be whole or absent: verl's ranks delete the oldest checkpoint before writing the new "
            "one, and its tracker is written in place, so a node lost during a save can leave no whole checkpoint "
            "or a tracker cut short. Ours commits a step (marker, then an atomic tracker) only after every rank's "
            "save returned, and removes old ones after that (verl_patches/train/checkpoint_commit.py).",
        remove_when="verl's trainer commits a checkpoint atomically after all ranks saved (a completion marker or "
                    "an atomic tracker) and prunes old checkpoints only after the commit.",
        **_COMMON,
    ),
    Patch(
        id="verl.ray_trainer.checkpoint_resume_whole",
        target=_T + "_load_checkpoint",
        requires=("verl.ray_trainer.checkpoint_commit",),
        fingerprint=Fingerprint(signature="def _load_checkpoint(self)", source_sha="a27046514125e968"),
        replacement=f"{__name__}:load_checkpoint",
        why="verl resumes from the tracker's directory without checking that every rank's shards are there; ours "
            "takes the tracker's step only if its marker and files say it is whole, else the newest whole step "
            "below it, and refuses a named directory that is not whole.",
        remove_when="verl's resume checks a checkpoint's completeness before loading it.",
        **_COMMON,
    ),
]
