"""Old log-prob reuse, loss side: inside the update, the policy loss takes log_prob.detach() as the
old log-prob, so the importance ratio is exactly 1 in value and keeps its gradient (docs/RECIPE.md item 3).

Upstream: verl/trainer/ppo/core_algos.py:compute_policy_loss(old_log_prob, log_prob, ...) computes
ratio = exp(log_prob - old_log_prob). MegatronPPOActor's loss_func calls it by the name it imported
(`from ...core_algos import compute_policy_loss`), which the prelude rebinds. The substitution happens
only while ``reusing_old_log_prob()`` (verl_patches/train/old_log_prob.py) is active: the worker's update_actor wrapper
(patch_workers_megatron_workers_*.py) enters it when actor.recompute_old_log_prob=False, so every other
caller (FSDP actor, tests, a recompute run) reaches the original unchanged.

Why it is exact: on-policy GRPO takes one optimizer step per batch, so the policy of the update's
forward pass is the policy that produced the rollout; log_prob - log_prob.detach() is 0 in value and
d ratio / d log_prob = ratio = 1, the same gradient as the recomputed path.

The same call measures the rollout-vs-train mismatch: when the update is given an UpdateProbe
(verl_patches/train/mismatch.py), the old_log_prob it receives is the rollout's log-prob (or the NaN
placeholder without rollout.calculate_log_probs), and before substituting it the wrapper adds the
masked per-token comparison and the micro-batch's entropy to the probe, on the device.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.train.old_log_prob import active_probe, reuse_active


def wrap_compute_policy_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_policy_loss(old_log_prob, log_prob, *args, **kwargs):
        if reuse_active():
            probe = active_probe()
            if probe is not None:
                bound = signature.bind(old_log_prob, log_prob, *args, **kwargs)
                bound.apply_defaults()
                mask = bound.arguments["response_mask"]
                probe.add(log_prob, mask, probe.take_entropy(mask.shape[-1]),
                          rollout_log_prob=old_log_prob if probe.compare else None,
                          loss_agg_mode=bound.arguments["loss_agg_mode"])
            old_log_prob = log_prob.detach()
        return original(old_log_prob, log_prob, *args, **kwargs)

    return compute_policy_loss


PATCHES = [
    Patch(
        feature="old_log_prob_reuse",
        id="verl.old_log_prob.policy_loss",
        target="verl.trainer.ppo.core_algos:compute_policy_loss",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint(
            signature="def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange=None, "
                      "cliprange_low=None, cliprange_high=None, clip_ratio_c=3.0, loss_agg_mode: str='token-mean')",
            source_sha="a8e0143d6a8e0533",
        ),
        replacement=f"{__name__}:wrap_compute_policy_loss",
        flag="actor_rollout_ref.actor.recompute_old_log_prob=False (verl's key; default True = upstream behaviour)",
        why="verl 0.4.1 reads recompute_old_log_prob in MegatronPPOActor.compute_log_prob but then returns an "
            "unbound name, and its update always needs old_log_probs: without a forward pass the loss must take "
            "log_prob.detach() as the old log-prob (docs/DESIGN.md section 4).",
        remove_when="verl's actor computes the ratio against log_prob.detach() itself when the old log-prob is not "
                    "recomputed (later verl releases add an on-policy path to the policy loss).",
    ),
]
