"""Old log-prob reuse, actor side: the update runs without old_log_probs from the driver and uses
log_prob.detach() instead, after checking that the batch really is one optimizer step; the same
forward passes measure the rollout-vs-train mismatch and the entropy (verl_patches/train/mismatch.py).

Upstream: verl/workers/actor/megatron_actor.py. MegatronPPOActor.make_minibatch_iterator selects
old_log_probs from the batch (KeyError without it) and splits the batch into mini batches x epochs;
update_policy runs forward_backward_batch, whose loss_func calls compute_policy_loss(old_log_prob, ...),
then the optimizer step.
- make_minibatch_iterator: refuses more than one mini batch or epoch (here, on the worker, with the
  per-rank sizes it really got); puts the rollout's log-probs (``rollout_log_probs``, present with
  rollout.calculate_log_probs=True) in old_log_probs, else a NaN placeholder; leaves the update's
  UpdateProbe on the actor.
- forward_backward_batch: under reuse, checks after the micro-batches and before the optimizer
  step that every micro-batch's loss went through the substitution (and took its entropy): a
  path that missed it would train on the rollout's log-prob as the old one, so it is an error.
  It also notes how the batch was split (actor/micro_batch*): fixed micro_batch_size chunks, or
  with actor.use_dynamic_bsz verl's rearrange_micro_batches (balanced by token count up to
  ppo_max_token_len_per_gpu, rows reordered; the indices it returns say which rows went where).
  Reordering needs nothing of ours: the rollout's log-probs ride in old_log_probs, a field of the
  same rows, so every micro-batch compares its own rows.
- update_policy: runs inside reusing_old_log_prob(probe), where the policy loss substitutes
  log_prob.detach() (patch_trainer_ppo_core_algos.py); afterwards one all_gather over the
  data-parallel group turns the probe into the global metrics, added to the update's.
The actor's config is actor_rollout_ref.actor.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.train.old_log_prob import active_probe, reusing_old_log_prob

RECOMPUTE_KEY = "recompute_old_log_prob"  # in actor_rollout_ref.actor; verl's default True
ROLLOUT_LOG_PROBS = "rollout_log_probs"  # verl's vLLM rollout, with rollout.calculate_log_probs=True


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
            # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
            # when the patch runs.
            import torch
            from verl_patches.train.mismatch import UpdateProbe

            check_one_step(len(data), self.config)
            compare = ROLLOUT_LOG_PROBS in data.batch.keys()
            if compare:
                # The rollout's log-probs ride in the old_log_probs slot verl splits into micro-batches;
                # the loss compares them with its own and then substitutes log_prob.detach().
                data.batch["old_log_probs"] = data.batch[ROLLOUT_LOG_PROBS]
            elif "old_log_probs" not in data.batch.keys():
                responses = data.batch["responses"]
                # NaN, stride 0: no memory, and a path that missed the substitution gives a NaN loss.
                data.batch["old_log_probs"] = torch.full((1, 1), float("nan"), dtype=torch.float32,
                                                         device=responses.device).expand(len(data), responses.shape[-1])
            stash.put(self, "update_probe", UpdateProbe(compare, self.config.get("loss_agg_mode", "token-mean")))
        return original(self, data)

    return make_minibatch_iterator


def wrap_forward_backward_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward_backward_batch(self, *args, **kwargs):
        probe = active_probe()
        if probe is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["forward_only"]:
            return original(self, *args, **kwargs)
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.train.mismatch import MismatchError

        before = probe.calls
        out = original(self, *args, **kwargs)
        _note_split(probe, _arguments(bound), out)
        # Megatron's schedule returns one loss output per micro-batch on the last pipeline stage (none
        # on the others): each of them must have gone through the substitution.
        losses, intercepted = len(out["output"]), probe.calls - before
        if intercepted != losses or probe.pending_entropy():
            raise MismatchError(
                f"old log-prob reuse: {losses} micro-batch loss(es) ran but {intercepted} went through the "
                "substitution (patch verl.old_log_prob.policy_loss)"
                + (", and an entropy was left untaken" if probe.pending_entropy() else "")
                + "; the loss would have used the rollout's log-prob as the old one. Stopped before the optimizer "
                "step: check `python -m verl_patches doctor` in the workers, or set actor.recompute_old_log_prob=True")
        return out

    return forward_backward_batch


def _arguments(bound: inspect.BoundArguments) -> dict:
    """The call's arguments by name, those taken by a ``**kwargs`` parameter included."""
    out = dict(bound.arguments)
    for name, param in bound.signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(out.pop(name, {}))
    return out


def _note_split(probe: Any, arguments: dict, out: dict) -> None:
    """Tell the probe how forward_backward_batch split this rank's batch: verl's own partition with
    use_dynamic_bsz (out["indices"], rows of the batch per micro-batch), else its split into
    micro_batch_size chunks. The largest micro-batch's tokens stay a device scalar."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch
    from verl_patches.train.mismatch import MismatchError

    data = arguments["data"]
    rows = len(data)
    if arguments.get("use_dynamic_bsz", False):
        if "indices" not in out:
            raise MismatchError("forward_backward_batch ran with use_dynamic_bsz=True but returned no micro-batch "
                                "indices (verl 0.4.1 returns them as out['indices'])")
        parts = [list(p) for p in out["indices"]]
    else:
        size = arguments.get("micro_batch_size")
        if not isinstance(size, int) or size < 1:
            raise MismatchError(f"forward_backward_batch ran without dynamic batch sizes and with micro_batch_size="
                                f"{size!r}: cannot tell how the update split its batch")
        parts = [list(range(s, min(s + size, rows))) for s in range(0, rows, size)]
    if sorted(i for p in parts for i in p) != list(range(rows)):
        raise MismatchError(f"the update's micro-batches {parts} do not cover the {rows} rows of the batch once each")
    lengths = data.batch["attention_mask"].sum(-1)
    tokens = torch.stack([lengths[torch.tensor(p, device=lengths.device)].sum() for p in parts])
    probe.note_split([len(p) for p in parts], tokens.max())


def _data_parallel_group():
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_group()


def wrap_update_policy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_policy(self, dataloader):
        if not reusing(self.config):
            return original(self, dataloader)
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        from verl_patches.base import accelerator
        from verl_patches.train.mismatch import MismatchError

        probe = stash.get(self, "update_probe")
        if probe is None:
            raise MismatchError("old log-prob reuse: update_policy got a batch that did not come through "
                                "make_minibatch_iterator's patch (verl.old_log_prob.minibatch)")
        stash.put(self, "update_probe", None)
        with reusing_old_log_prob(probe):
            metrics = original(self, dataloader)
        # One small collective per update: every data-parallel rank gets the global figures, so the
        # metrics verl collects from one rank are the whole batch's.
        for key, value in probe.reduce(_data_parallel_group(), accelerator.current_device()).items():
            metrics[key] = [value]
        return metrics

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
            "them (and drops rollout_log_probs, which the mismatch measurement needs per micro-batch); and reuse is "
            "only exact for one mini batch and one epoch, which only the worker can see in the per-rank sizes it received.",
        remove_when="verl's actor supports on-policy updates without old_log_probs in the batch.",
        **_COMMON,
    ),
    Patch(
        feature="old_log_prob_reuse",
        id="verl.old_log_prob.micro_batch_check",
        requires=("verl.old_log_prob.policy_loss", "verl.old_log_prob.minibatch"),
        target="verl.workers.actor.megatron_actor:MegatronPPOActor.forward_backward_batch",
        fingerprint=Fingerprint(
            signature="def forward_backward_batch(self, data: DataProto, forward_only=False, post_process_fn=None, "
                      "calculate_entropy=False, use_dynamic_bsz=False, micro_batch_size=None, max_token_len=None, "
                      "mini_batch_size=None)",
            source_sha="2bd46c770aeb5d26"),
        replacement=f"{__name__}:wrap_forward_backward_batch",
        why="With rollout.calculate_log_probs=True the batch's old_log_probs are the rollout's, a real value: a "
            "micro-batch whose loss missed the substitution would train on it silently. The check sits between the "
            "micro-batches and the optimizer step, the one place where both the loss outputs and the step are in reach.",
        remove_when="verl's actor computes the on-policy ratio itself (see verl.old_log_prob.policy_loss).",
        **_COMMON,
    ),
    Patch(
        feature="old_log_prob_reuse",
        id="verl.old_log_prob.update_policy",
        requires=("verl.old_log_prob.policy_loss", "verl.old_log_prob.minibatch", "verl.old_log_prob.micro_batch_check"),
        target="verl.workers.actor.megatron_actor:MegatronPPOActor.update_policy",
        fingerprint=Fingerprint(signature="def update_policy(self, dataloader: Iterable[DataProto]) -> Dict",
                                source_sha="64d3665802aee83a"),
        replacement=f"{__name__}:wrap_update_policy",
        why="The policy loss must take log_prob.detach() as the old log-prob during the update only; the loss "
            "function is a closure inside forward_backward_batch, so the update is where the switch can be set. It "
            "also reduces the update's rollout-mismatch and entropy sums over data parallel (one all_gather) into "
            "metrics: verl collects the update's metrics from one rank.",
        remove_when="verl's actor computes the on-policy ratio itself (see verl.old_log_prob.policy_loss).",
        **_COMMON,
    ),
]
