"""A driver process for tests/patches/verl/test_checkpoint_commit.py: verl's RayPPOTrainer._save_checkpoint with
patch verl.ray_trainer.checkpoint_commit applied, over a stand-in worker group of RANKS ranks that each write
their shard file. ``python checkpoint_child.py ROOT KEEP STEP[:STOP] ...`` saves each STEP in turn; STOP makes
the save of that step stop for good (the test SIGKILLs the process there) at one point:

- ``rank=K``: after ranks 0..K-1 wrote their shards (a node lost between shards);
- ``marker``: after the marker, before the tracker;
- ``replace``: inside the tracker's write, its new content on disk under the temporary name, before the rename.

The line ``STOPPED`` on stdout says the process has reached the point.
"""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

RANKS = 4


def _stop() -> None:
    print("STOPPED", flush=True)
    while True:
        time.sleep(60)


class WorkerGroup:
    """verl's actor_rollout_wg.save_checkpoint as the driver sees it: returns once every rank returned."""

    def __init__(self) -> None:
        self.stop_after_rank: int | None = None
        self.loaded: list[str] = []

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        assert max_ckpt_to_keep is None, "no rank may remove a checkpoint before the commit"
        path = Path(local_path)
        path.mkdir(parents=True, exist_ok=True)
        for rank in range(RANKS):
            if rank == self.stop_after_rank:
                _stop()
            (path / f"__{rank}_0.distcp").write_bytes(bytes([global_step % 256]) * (1000 + rank))

    def load_checkpoint(self, local_path, del_local_after_load=False):
        self.loaded.append(local_path)


class Loader:
    def __init__(self) -> None:
        self.state = {"consumed": 0}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def trainer(root: str, keep: int | None, resume_mode: str = "auto", resume_from_path: str | None = None):
    from omegaconf import OmegaConf

    config = OmegaConf.create({
        "trainer": {"default_local_dir": root, "default_hdfs_dir": None, "max_actor_ckpt_to_keep": keep,
                    "resume_mode": resume_mode, "resume_from_path": resume_from_path,
                    "del_local_ckpt_after_load": False},
        "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": False}}},
    })
    return types.SimpleNamespace(config=config, global_steps=0, actor_rollout_wg=WorkerGroup(), use_critic=False,
                                 train_dataloader=Loader())


def main(argv: list[str]) -> None:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from verl_patches.core.apply import apply_all
    from verl_patches.patches.verl import patch_trainer_ppo_ray_trainer_checkpoint as patch
    from verl_patches.train import checkpoint_commit as cc

    apply_all(patch.PATCHES)
    root, keep = argv[0], (int(argv[1]) or None)
    t = trainer(root, keep)
    for arg in argv[2:]:
        step, _, stop = arg.partition(":")
        t.global_steps = int(step)
        t.train_dataloader.state = {"consumed": 10 * int(step)}
        t.actor_rollout_wg.stop_after_rank = int(stop.split("=")[1]) if stop.startswith("rank=") else None
        if stop == "marker":
            cc.write_tracker = lambda *a, **k: _stop()
        if stop == "replace":
            real = os.replace

            def replace(src, dst, _real=real):
                if Path(dst).name == cc.TRACKER:
                    _stop()
                return _real(src, dst)

            os.replace = replace
        RayPPOTrainer._save_checkpoint(t)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
