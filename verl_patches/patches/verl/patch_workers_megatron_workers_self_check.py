"""The run's self-checks, worker side: the trainer's global step of a generation request (put in its
meta_info by patch_trainer_ppo_ray_trainer_self_check.py) is left on the sharding manager before verl's
body enters it, so the reshard's weight fingerprint (patch_workers_sharding_manager_megatron_vllm.py)
names the step when it stops the run.

Upstream: verl/workers/megatron_workers.py:ActorRolloutRefWorker.generate_sequences enters
``self.sharding_manager`` (the reshard) before it looks at the prompts.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def wrap_generate_sequences_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate_sequences(self, prompts):
        manager = getattr(self, "sharding_manager", None)
        if manager is not None:
            meta = getattr(prompts, "meta_info", None) or {}
            step = meta.get(stash.STEP_META_KEY)
            stash.put(manager, "step", None if step is None else
                      (f"{step} (validation)" if meta.get("validate") else step))
        return original(self, prompts)

    return generate_sequences


PATCHES = [
    Patch(
        feature="self_check",
        id="verl.self_check.step_on_worker",
        after=("verl.tensor_cache.generate", "verl.megatron_worker.generate_offload",
               "verl.megatron_worker.generate_compile"),
        target="verl.workers.megatron_workers:ActorRolloutRefWorker.generate_sequences", kind="wrap",
        phases=("worker",), upstream="verl", versions="==0.4.1",
        fingerprint=Fingerprint(signature="def generate_sequences(self, prompts: DataProto)",
                                source_sha="9f3b8f496926ac8f"),
        replacement=f"{__name__}:wrap_generate_sequences_step",
        flag="always on (reads a meta_info entry)",
        why="The sharding manager's reshard runs the weight fingerprint before verl's body reads the prompts; the "
            "step it names comes with the prompts, so it is left on the manager first.",
        remove_when="verl passes the global step to its sharding manager.",
    ),
]
