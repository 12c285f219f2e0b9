"""Driver side of old log-prob reuse and of the TensorCache: the trainer's loop calls its worker
groups through thin wrappers installed right after RayPPOTrainer.init_workers builds them.

Upstream: verl/trainer/ppo/ray_trainer.py. RayPPOTrainer.fit (300 lines) calls, per step,
actor_rollout_wg.generate_sequences, actor_rollout_wg.compute_log_prob, ref_policy_wg.compute_ref_log_prob
and actor_rollout_wg.update_actor with the whole batch. Replacing fit() would copy the loop; the
narrowest seam is the worker-group methods it calls, which init_workers creates as instance
attributes: we rebind those attributes on the instances (the cache right after init_workers, the
reuse at the start of fit), so fit() itself runs as shipped. Each feature checks its configuration
before the first step and names every setting it cannot serve.

- Old log-prob reuse (actor.recompute_old_log_prob=False): compute_log_prob becomes a local call that
  sends nothing and runs no forward; the workers' update uses log_prob.detach()
  (patch_workers_actor_megatron_actor.py, patch_trainer_ppo_core_algos.py) and measures the
  rollout-vs-train mismatch (with rollout.calculate_log_probs=True) and the entropy from its own
  forward. Invalid configurations are rejected with the reason.
- TensorCache (actor_rollout_ref.rollout.recipe.tensor_cache, default True as in the recipe):
  generation keeps its outputs on the devices and returns only the host fields; the later stages
  receive only what the host computed (advantages) plus the row ids of the driver's current order.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable

from verl_patches.core import stash
from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch
from verl_patches.tensor_cache.protocol import (HOST_KEYS_FROM_GENERATION, META_KEY, ROW_KEY, STAGE_INPUTS,
                                                WORKER_NON_TENSOR_KEYS)
from verl_patches.config import settings

TENSOR_CACHE_KEY = "actor_rollout_ref.rollout.recipe.tensor_cache"
RECOMPUTE_KEY = "actor_rollout_ref.actor.recompute_old_log_prob"
# verl 0.4.1's own default (MegatronPPOActor reads the key with .get(..., True)).
RECOMPUTE_DEFAULT = True
LOCAL_ATTR = stash.attr("local_call")  # marks a replacement that never calls the workers

_INIT_WORKERS_FP = Fingerprint(signature="def init_workers(self)", source_sha="4a3b24c45c6ad122")
_FIT_FP = Fingerprint(signature="def fit(self)", source_sha="06a2a1e2c639c034")


def _select(config: Any, key: str, default: Any) -> Any:
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=default)
    return default if value is None else value


# ---------------------------------------------------------------------------------------------
# Old log-prob reuse
# ---------------------------------------------------------------------------------------------

def reuse_old_log_prob(config: Any) -> bool:
    return not bool(_select(config, RECOMPUTE_KEY, RECOMPUTE_DEFAULT))


def check_reuse_config(config: Any) -> None:
    """Raise ValueError naming every setting that makes log_prob.detach() a wrong old log-prob."""
    actor = config.actor_rollout_ref.actor
    problems = []
    epochs = _select(config, "actor_rollout_ref.actor.ppo_epochs", 1)
    if epochs != 1:
        problems.append(f"actor.ppo_epochs={epochs}: every epoch after the first trains a policy that no "
                        "longer produced the rollout (set it to 1)")
    train, mini = config.data.train_batch_size, actor.ppo_mini_batch_size
    if train != mini:
        problems.append(f"data.train_batch_size={train} != actor.ppo_mini_batch_size={mini}: "
                        f"{train / mini:g} optimizer steps per batch, and every step after the first trains an "
                        "updated policy (set them equal)")
    loss_mode = _select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    if loss_mode != "vanilla":
        problems.append(f"actor.policy_loss.loss_mode={loss_mode!r}: the reuse is wired into the vanilla "
                        "policy loss only")
    if _select(config, "algorithm.use_kl_in_reward", False):
        problems.append("algorithm.use_kl_in_reward=True: the KL penalty in the reward needs the old log-prob "
                        "on the host before the update")
    strategy = _select(config, "actor_rollout_ref.actor.strategy", "megatron")
    if strategy != "megatron":
        problems.append(f"actor.strategy={strategy!r}: the reuse is wired into the Megatron worker only")
    if problems:
        raise ValueError(f"{RECOMPUTE_KEY}=False (old log-prob reuse) is invalid here:\n  - "
                         + "\n  - ".join(problems)
                         + f"\nFix these or set {RECOMPUTE_KEY}=True to recompute the old log-prob.")


def skipped_compute_log_prob(data: Any) -> Any:
    """Stand-in for actor_rollout_wg.compute_log_prob: no worker call, no forward pass.

    The trainer still reads ``entropys`` for its actor/entropy metric, and, when the rollout's
    log-probs are on the host (rollout.calculate_log_probs=True without the TensorCache),
    ``old_log_probs`` for its training/rollout_probs_diff_* metrics. Both get NaN (not computed
    here), as a zero would read as a real figure: the update measures both from its own forward
    and its metrics, merged after these, replace them (a NaN that reached the report would stop
    the run). No old_log_probs otherwise: the update makes its own."""
    # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported when
    # the patch runs.
    import torch
    from verl.protocol import DataProto

    rows, width = len(data), data.batch["responses"].shape[-1]
    # A stride-0 view: the metric needs the shape, not B x R floats.
    nan = torch.full((1, 1), float("nan"), dtype=torch.float32).expand(rows, width)
    tensors = {"entropys": nan}
    if "rollout_log_probs" in data.batch.keys():
        tensors["old_log_probs"] = nan
    return DataProto.from_dict(tensors=tensors)


setattr(skipped_compute_log_prob, LOCAL_ATTR, True)


def wrap_fit_old_log_prob(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fit(self):
        if reuse_old_log_prob(self.config):
            check_reuse_config(self.config)
            self.actor_rollout_wg.compute_log_prob = skipped_compute_log_prob
        return original(self)

    return fit


# ---------------------------------------------------------------------------------------------
# TensorCache, driver side
# ---------------------------------------------------------------------------------------------

def tensor_cache_on(config: Any) -> bool:
    return settings.from_trainer(config).tensor_cache


def check_tensor_cache_config(trainer: Any) -> None:
    """Raise ValueError naming what the TensorCache cannot serve (their stages need the full batch)."""
    config = trainer.config
    problems = []
    if trainer.use_critic:
        problems.append("a critic (adv_estimator needs values): its worker group would need input_ids on the host")
    if trainer.use_rm:
        problems.append("a model-based reward (reward_model.enable=True): its worker group would need the full batch")
    if _select(config, "actor_rollout_ref.rollout.mode", "sync") == "async":
        problems.append("rollout.mode=async: generation does not run through actor_rollout_wg.generate_sequences")
    strategy = _select(config, "actor_rollout_ref.actor.strategy", "megatron")
    if strategy != "megatron":
        problems.append(f"actor.strategy={strategy!r}: the worker side is wired into the Megatron worker only")
    if problems:
        raise ValueError(f"{TENSOR_CACHE_KEY}=True is not supported with:\n  - " + "\n  - ".join(problems)
                         + f"\nSet {TENSOR_CACHE_KEY}=False to send full batches as upstream does.")


class DriverCacheState:
    """What the driver knows about the workers' caches in the current step."""

    _ids = itertools.count()

    def __init__(self, host_needs_log_probs: bool) -> None:
        self.host_needs_log_probs = host_needs_log_probs
        self.step: str | None = None
        self.cached: set[str] = set()
        self.last_rows: Any = None

    def begin(self) -> None:
        self.step = f"step-{next(self._ids)}"
        self.cached = set()
        self.last_rows = None

    def reset(self) -> None:
        self.step, self.cached, self.last_rows = None, set(), None

    def take_reply(self, out: Any, op: str) -> None:
        reply = out.meta_info.pop(META_KEY, None)
        if reply is None:
            raise RuntimeError(f"TensorCache: the workers answered {op} without a cache reply: the worker-side "
                               "patches (verl.tensor_cache.*) are not applied in the worker processes; check "
                               "`python -m verl_patches doctor` and the prelude hook")
        self.cached |= set(reply["cached"])


def _wrap_generate(state: DriverCacheState, original: Callable[..., Any]) -> Callable[..., Any]:
    def generate_sequences(gen_batch, *args, **kwargs):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        import torch

        # Validation batches (meta_info validate, padded to the world size) are not part of a step.
        if args or kwargs or gen_batch.meta_info.get("validate") or gen_batch.is_padding_enabled():
            state.reset()
            return original(gen_batch, *args, **kwargs)
        state.begin()
        gen_batch.meta_info[META_KEY] = {"step": state.step, "op": "generate_sequences",
                                         "host_keys": list(HOST_KEYS_FROM_GENERATION)}
        try:
            out = original(gen_batch)
        finally:
            gen_batch.meta_info.pop(META_KEY, None)
        state.take_reply(out, "generate_sequences")
        out.batch[ROW_KEY] = torch.arange(len(out), dtype=torch.int64)
        return out

    return generate_sequences


def _wrap_stage(state: DriverCacheState, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    if op == "compute_log_prob":
        keep, returned = ["old_log_probs"], ["entropys"] + (["old_log_probs"] if state.host_needs_log_probs else [])
    elif op == "compute_ref_log_prob":
        keep, returned = ["ref_log_prob"], (["ref_log_prob"] if state.host_needs_log_probs else [])
    else:
        keep, returned = [], []

    def stage(data, *args, **kwargs):
        # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
        # when the patch runs.
        import torch
        from verl.protocol import DataProto

        if state.step is None or args or kwargs:
            return original(data, *args, **kwargs)
        if ROW_KEY not in data.batch.keys():
            raise RuntimeError(f"TensorCache: the batch given to {op} has no {ROW_KEY!r} column; it was not built "
                               "from this step's generate_sequences output, so the workers cannot find its rows")
        rows = data.batch[ROW_KEY]
        wanted = STAGE_INPUTS[op]
        from_cache = [k for k in wanted if k in state.cached]
        send = [k for k in wanted if k not in state.cached and k in data.batch.keys()]
        unchanged = state.last_rows is not None and torch.equal(rows, state.last_rows)
        meta = dict(data.meta_info)
        meta[META_KEY] = {"step": state.step, "op": op, "from_cache": from_cache, "unchanged": unchanged,
                          "cache": keep, "return": returned}
        small = DataProto.from_dict(
            tensors={ROW_KEY: rows, **{k: data.batch[k] for k in send}},
            non_tensors={k: v for k, v in data.non_tensor_batch.items() if k in WORKER_NON_TENSOR_KEYS},
            meta_info=meta,
        )
        out = original(small)
        state.last_rows = rows.clone()
        state.take_reply(out, op)
        if out.batch is None and op != "update_actor":
            # Lazy: the doctor loads the catalogue, this module included, without torch or the upstream stack; imported
            # when the patch runs.
            from tensordict import TensorDict

            # The trainer unions the result into its batch: give it the batch's row count, no keys.
            out.batch = TensorDict({}, batch_size=[len(data)])
        if op == "update_actor":
            state.reset()  # the workers dropped the step's tensors
        return out

    return stage


def install_tensor_cache(trainer: Any) -> DriverCacheState:
    """Rebind the trainer's worker-group methods to the cache-aware wrappers; return the state."""
    state = DriverCacheState(bool(_select(trainer.config, "algorithm.use_kl_in_reward", False)))
    wg = trainer.actor_rollout_wg
    wg.generate_sequences = _wrap_generate(state, wg.generate_sequences)
    if not getattr(wg.compute_log_prob, LOCAL_ATTR, False):
        wg.compute_log_prob = _wrap_stage(state, "compute_log_prob", wg.compute_log_prob)
    wg.update_actor = _wrap_stage(state, "update_actor", wg.update_actor)
    if trainer.use_reference_policy:
        ref_wg = trainer.actor_rollout_wg if trainer.ref_in_actor else trainer.ref_policy_wg
        ref_wg.compute_ref_log_prob = _wrap_stage(state, "compute_ref_log_prob", ref_wg.compute_ref_log_prob)
    trainer.tensor_cache_state = state
    return state


def wrap_init_workers_tensor_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_workers(self):
        on = tensor_cache_on(self.config)
        if on:
            check_tensor_cache_config(self)
        result = original(self)
        if on:
            install_tensor_cache(self)
        return result

    return init_workers


PATCHES = [
    Patch(
        feature="tensor_cache",
        id="verl.tensor_cache.driver",
        target="verl.trainer.ppo.ray_trainer:RayPPOTrainer.init_workers", kind="wrap", phases=("driver",),
        upstream="verl", versions="==0.4.1", fingerprint=_INIT_WORKERS_FP,
        replacement=f"{__name__}:wrap_init_workers_tensor_cache",
        flag=f"{TENSOR_CACHE_KEY} (default True: verl_patches/config/settings.py)",
        why="verl 0.4.1's single controller sends every stage the whole batch through Ray, one worker after "
            "another (57-73 s apart on 256 dies in the reference run), and receives it back; with the cache the "
            "driver sends only what it computed (advantages) and row ids (docs/RECIPE.md item 4, docs/DESIGN.md section 5).",
        remove_when="verl keeps stage outputs on the workers between stages (a data plane that passes device "
                    "tensors between worker groups instead of through the driver).",
    ),
    Patch(
        feature="old_log_prob_reuse",
        id="verl.old_log_prob.skip_forward",
        target="verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit", kind="wrap", phases=("driver",),
        upstream="verl", versions="==0.4.1", fingerprint=_FIT_FP,
        replacement=f"{__name__}:wrap_fit_old_log_prob",
        flag=f"{RECOMPUTE_KEY}=False (verl's key; default True = upstream behaviour)",
        why="verl 0.4.1's fit() always calls compute_log_prob (a full forward of the 671B actor), and with "
            "recompute_old_log_prob=False its Megatron actor fails on an unbound name; for on-policy GRPO the old "
            "log-prob is the update's own, so the forward is skipped (docs/RECIPE.md item 3: old log-prob 0 s).",
        remove_when="verl's trainer skips compute_log_prob itself for on-policy updates (one mini batch, one epoch).",
    ),
]
