"""The run's self-checks, driver side: every generation request carries the trainer's global step, so a
check that fails on a worker (the weight fingerprint after the reshard, verl_patches/reshard/checksum.py)
names the step the person sees in the run's report. The other stage calls (the old and the reference
log-prob forwards, the update) carry it too, for the run's profiles (recipe.profile,
verl_patches/base/profile.py), which profile chosen stages of chosen steps on the workers.

Upstream: verl/trainer/ppo/ray_trainer.py. RayPPOTrainer.fit calls actor_rollout_wg.generate_sequences
with a batch whose meta_info holds no step (validation's holds ``validate``). As the TensorCache does
(patch_trainer_ppo_ray_trainer.py), we rebind the worker group's method on the instance, right after
init_workers builds it; the wrapper reads ``trainer.global_steps`` when it is called.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def _with_step(trainer: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    def call(data, *args, **kwargs):
        step = getattr(trainer, "global_steps", None)
        if step is not None:
            data.meta_info[stash.STEP_META_KEY] = int(step)
        return original(data, *args, **kwargs)

    return call


# The worker-group calls that carry the step: the actor's (generate_sequences first, as the fingerprint needs it)
# and the reference's log-prob forward.
ACTOR_CALLS = ("generate_sequences", "compute_log_prob", "update_actor")
REF_CALL = "compute_ref_log_prob"


def wrap_init_workers_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_workers(self):
        out = original(self)
        wg = self.actor_rollout_wg
        for name in ACTOR_CALLS:
            setattr(wg, name, _with_step(self, getattr(wg, name)))
        if getattr(self, "use_reference_policy", False):
            ref = wg if getattr(self, "ref_in_actor", False) else self.ref_policy_wg
            setattr(ref, REF_CALL, _with_step(self, getattr(ref, REF_CALL)))
        return out

    return init_workers


PATCHES = [
    Patch(
        feature="self_check",
        id="verl.self_check.step_to_workers", after=("verl.tensor_cache.driver",),
        target="verl.trainer.ppo.ray_trainer:RayPPOTrainer.init_workers", kind="wrap", phases=("driver",),
        upstream="verl", versions="==0.4.1",
        fingerprint=Fingerprint(signature="def init_workers(self)", source_sha="4a3b24c45c6ad122"),
        replacement=f"{__name__}:wrap_init_workers_step",
        flag="always on (a meta_info entry; the checks it serves have their own settings)",
        why="The workers' per-step checks (weight fingerprint) must name the trainer's step, and the run's "
            "profiles (recipe.profile) choose stages by it, which only the driver knows: verl 0.4.1 sends its "
            "stage calls no step (docs/DESIGN.md, 'The run checks itself').",
        remove_when="verl passes the global step to its stage calls in meta_info.",
    ),
]
