"""Old log-prob reuse, actor side: the update runs without old_log_probs from the driver and uses
log_prob.detach() instead, after checking that the batch really is one optimizer step.

Upstream: verl/workers/actor/megatron_actor.py. MegatronPPOActor.make_minibatch_iterator selects
old_log_probs from the batch (KeyError without it) and splits the batch into mini batches x epochs;
update_policy runs forward/backward whose loss_func calls compute_policy_loss(old_log_prob, ...).
We wrap make_minibatch_iterator to refuse more than one mini batch or epoch (here, on the worker,
with the per-rank sizes it really got) and to add a NaN placeholder for old_log_probs; we wrap
update_policy to run inside reusing_old_log_prob(), where the policy loss substitutes
log_prob.detach() (patch_trainer_ppo_core_algos.py). The actor's config is actor_rollout_ref.actor.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

RECOMPUTE_KEY = "recompute_old_log_prob"  # in actor_rollout_ref.actor; verl's default True


def reusing(actor_config: Any) -> bool:
    return not bool(actor_config.get(RECOMPUTE_KEY, True))


def check_one_step(rows: int, actor_config: Any) -> None:
    """Raise ValueError unless this update is exactly one mini batch and one epoch on this rank."""
    mini = actor_config.ppo_mini_batch_size  # per data-parallel rank (the worker scales it at init)
    epochs = actor_config.get("ppo_epochs", 1)
    problems = []
    if rows != mini:
        problems.append(f"this rank got {rows} sequences but ppo_mini_batch_size is {mini} sequences per "
                        f"data-parallel rank ({rows / mini:g} mini batches)")
    if epochs != 1:
        problems.append(f"ppo_epochs={epochs}")
    if problems:
        raise ValueError("actor.recompute_old_log_prob=False (old log-prob reuse) needs exactly one optimizer step "
                         "per batch, but " + " and ".join(problems) + "; set data.train_batch_size equal to "
                         "actor.ppo_mini_batch_size and ppo_epochs=1, or recompute_old_log_prob=True")


def wrap_make_minibatch_iterator(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def make_minibatch_iterator(self, data):
        if reusing(self.config):
            import torch

            check_one_step(len(data), self.config)
            if "old_log_probs" not in data.batch.keys():
                responses = data.batch["responses"]
                # NaN, stride 0: no memory, and a path that missed the substitution gives a NaN loss.
                data.batch["old_log_probs"] = torch.full((1, 1), float("nan"), dtype=torch.float32,
                                                         device=responses.device).expand(len(data), responses.shape[-1])
        return original(self, data)

    return make_minibatch_iterator


def wrap_update_policy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_policy(self, dataloader):
        if not reusing(self.config):
            return original(self, dataloader)
        from verl_patches.patches.verl.patch_trainer_ppo_core_algos import reusing_old_log_prob

        with reusing_old_log_prob():
            return original(self, dataloader)

    return update_policy


_COMMON = dict(kind="wrap", phases=("worker",), upstream="verl", versions="==0.4.1",
               flag="actor_rollout_ref.actor.recompute_old_log_prob=False (verl's key; default True = upstream)")

PATCHES = [
    Patch(
        feature="old_log_prob_reuse",
        id="verl.old_log_prob.minibatch", requires=("verl.old_log_prob.policy_loss",),
        target="verl.workers.actor.megatron_actor:MegatronPPOActor.make_minibatch_iterator",
        fingerprint=Fingerprint(signature="def make_minibatch_iterator(self, data: DataProto) -> Iterable[DataProto]",
                                source_sha="51133b35874dbcb5"),
        replacement=f"{__name__}:wrap_make_minibatch_iterator",
        why="Without the old-log-prob forward the batch has no old_log_probs and verl 0.4.1's iterator selects "
            "them; and reuse is only exact for one mini batch and one epoch, which only the worker can see in "
            "the per-rank sizes it received.",
        remove_when="verl's actor supports on-policy updates without old_log_probs in the batch.",
        **_COMMON,
    ),
    Patch(
        feature="old_log_prob_reuse",
        id="verl.old_log_prob.update_policy", requires=("verl.old_log_prob.policy_loss", "verl.old_log_prob.minibatch"),
        target="verl.workers.actor.megatron_actor:MegatronPPOActor.update_policy",
        fingerprint=Fingerprint(signature="def update_policy(self, dataloader: Iterable[DataProto]) -> Dict",
                                source_sha="64d3665802aee83a"),
        replacement=f"{__name__}:wrap_update_policy",
        why="The policy loss must take log_prob.detach() as the old log-prob during the update only; the loss "
            "function is a closure inside forward_backward_batch, so the update is where the switch can be set.",
        remove_when="verl's actor computes the on-policy ratio itself (see verl.old_log_prob.policy_loss).",
        **_COMMON,
    ),
]
