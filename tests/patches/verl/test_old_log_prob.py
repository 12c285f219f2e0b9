"""Old log-prob reuse through verl 0.4.1's real MegatronPPOActor.make_minibatch_iterator and
update_policy bodies and its real compute_policy_loss: same loss and gradients as the recomputed
path, invalid configurations rejected on the driver and on the worker.

The Megatron model is the only stand-in (a one-layer torch policy on CPU, since a Megatron GPT needs
a device): forward_backward_batch computes log-probs with it and calls the loss exactly as verl's
loss_func does (the module-level compute_policy_loss name of megatron_actor, same arguments).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from omegaconf import OmegaConf

from verl_patches.core import apply as ap
from verl_patches.patches.verl import patch_trainer_ppo_core_algos as loss_patch
from verl_patches.patches.verl import patch_trainer_ppo_ray_trainer as driver_patch
from verl_patches.patches.verl import patch_workers_actor_megatron_actor as actor_patch

B, P, R, V, H = 6, 3, 5, 11, 4  # sequences, prompt, response, vocab, hidden
ALL = loss_patch.PATCHES + actor_patch.PATCHES


def _without_requirement(patch, dep):
    return dataclasses.replace(patch, requires=tuple(r for r in patch.requires if r != dep))


@pytest.fixture
def patched():
    ap.apply_all(ALL)
    yield
    ap.undo()


def _batch(seed=0):
    from verl.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (B, P + R), generator=g)
    attention_mask = torch.ones(B, P + R, dtype=torch.int64)
    attention_mask[0, -2:] = 0  # a short response: the mask must matter
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": torch.arange(P + R).expand(B, -1).clone(),
        "responses": input_ids[:, -R:].clone(),
        "advantages": torch.randn(B, R, generator=g),
    }, meta_info={"micro_batch_size": 2})


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.emb = torch.nn.Parameter(torch.randn(V, H, generator=g))
        self.out = torch.nn.Parameter(torch.randn(H, V, generator=g))

    def log_prob(self, input_ids, responses):
        logits = torch.tanh(self.emb[input_ids[:, -R - 1:-1]]) @ self.out
        return torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def _actor(policy, recompute: bool, mini=B, epochs=1):
    """An object carrying what the real update_policy / make_minibatch_iterator bodies read."""
    import verl.workers.actor.megatron_actor as ma

    cfg = OmegaConf.create({
        "ppo_mini_batch_size": mini, "ppo_epochs": epochs, "data_loader_seed": 0, "shuffle": False,
        "use_kl_loss": False, "entropy_coeff": 0, "ppo_micro_batch_size_per_gpu": 2, "use_dynamic_bsz": False,
        "recompute_old_log_prob": recompute, "clip_ratio": 0.2, "loss_agg_mode": "token-mean",
    })
    seen = {"loss": [], "stats": []}

    def forward_backward_batch(data, **_):
        for micro in data.batch.split(2):
            log_prob = policy.log_prob(micro["input_ids"], micro["responses"])
            mask = micro["attention_mask"][:, -R:].bool()
            # The call verl's loss_func makes (megatron_actor.py, vanilla loss mode).
            pg_loss, clipfrac, ppo_kl, _ = ma.compute_policy_loss(
                old_log_prob=micro["old_log_probs"], log_prob=log_prob, advantages=micro["advantages"],
                response_mask=mask, cliprange=0.2, cliprange_low=0.2, cliprange_high=0.2, clip_ratio_c=3.0,
                loss_agg_mode="token-mean")
            pg_loss.backward()
            seen["loss"].append(pg_loss.detach())
            seen["stats"].append((clipfrac.detach(), ppo_kl.detach()))
        return {"output": []}

    opt = types.SimpleNamespace(zero_grad=lambda: None, step=lambda: (True, 0.0, None))
    prof = types.SimpleNamespace(start=lambda: None, step=lambda: None, stop_and_save=lambda: None,
                                 stop_trace=lambda: None)
    actor = types.SimpleNamespace(config=cfg, actor_optimizer=opt, actor_module=[], prof=prof,
                                  forward_backward_batch=forward_backward_batch)
    return actor, seen


def _update(recompute: bool, data):
    import verl.workers.actor.megatron_actor as ma

    policy = Policy()
    if recompute:  # the separate old-log-prob forward the reuse skips
        with torch.no_grad():
            data.batch["old_log_probs"] = policy.log_prob(data.batch["input_ids"], data.batch["responses"])
    actor, seen = _actor(policy, recompute)
    loader = ma.MegatronPPOActor.make_minibatch_iterator(actor, data)
    ma.MegatronPPOActor.update_policy(actor, loader)
    return torch.stack(seen["loss"]), seen["stats"], [p.grad.clone() for p in policy.parameters()]


@pytest.fixture(autouse=True)
def _no_device_cache(monkeypatch):
    # update_policy and its GPUMemoryLogger decorator query the device module; torch.cpu has no
    # memory statistics in torch 2.5, so they get a zero-reporting stand-in on CPU.
    import verl.utils.debug.performance as perf
    import verl.workers.actor.megatron_actor as ma

    dev = types.SimpleNamespace(empty_cache=lambda: None, memory_allocated=lambda: 0, memory_reserved=lambda: 0,
                                mem_get_info=lambda: (0, 0))
    monkeypatch.setattr(ma, "get_torch_device", lambda: dev)
    monkeypatch.setattr(perf, "get_torch_device", lambda: dev)


def test_reuse_gives_the_recomputed_loss_and_gradients(patched):
    ref_loss, ref_stats, ref_grads = _update(True, _batch())
    loss, stats, grads = _update(False, _batch())  # no old_log_probs in the batch at all
    # Tolerance: exact (rtol=atol=0). On CPU the recomputed old log-prob comes from the identical
    # forward, so log_prob - old_log_prob is exactly 0 on both paths; on a device the recompute runs
    # other micro-batch shapes and differs in the last bits, which is the reuse's point.
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=0, atol=0)
    assert all(float(c) == 0.0 and float(k) == 0.0 for c, k in stats)  # ratio 1: nothing clipped, KL 0
    assert torch.isfinite(loss).all() and any(g.abs().sum() > 0 for g in grads)


def test_without_the_patches_the_update_cannot_run_or_gives_nan():
    with pytest.raises(KeyError, match="old_log_probs"):
        _update(False, _batch())
    # The actor-side patches require the loss substitution, and the applier says so.
    with pytest.raises(ap.PatchError, match="verl.old_log_prob.policy_loss"):
        ap.apply_all(actor_patch.PATCHES)
    # The requirement is real: placeholder and switch without the substitution (the declaration
    # dropped by hand) let the NaN placeholder reach the loss.
    ap.apply_all([_without_requirement(p, "verl.old_log_prob.policy_loss") for p in actor_patch.PATCHES])
    try:
        loss, _, _ = _update(False, _batch())
    finally:
        ap.undo()
    assert torch.isnan(loss).all()


def test_reuse_only_inside_the_update(patched):
    import verl.trainer.ppo.core_algos as ca

    lp = torch.zeros(1, 2, requires_grad=True)
    old = torch.full((1, 2), -1.0)
    out = ca.compute_policy_loss(old, lp, torch.ones(1, 2), torch.ones(1, 2), cliprange=0.2)
    assert float(out[2]) == pytest.approx(-1.0)  # ppo_kl = mean(old - new): the given old log-prob is used
    with loss_patch.reusing_old_log_prob():
        out = ca.compute_policy_loss(old, lp, torch.ones(1, 2), torch.ones(1, 2), cliprange=0.2)
    assert float(out[2]) == 0.0


@pytest.mark.parametrize("mini,epochs,message", [
    (B // 2, 1, r"this rank got 6 sequences but ppo_mini_batch_size is 3 sequences per data-parallel rank \(2 mini"),
    (B, 2, r"ppo_epochs=2"),
])
def test_worker_rejects_more_than_one_step(patched, mini, epochs, message):
    import verl.workers.actor.megatron_actor as ma

    actor, _ = _actor(Policy(), recompute=False, mini=mini, epochs=epochs)
    with pytest.raises(ValueError, match=message):
        ma.MegatronPPOActor.make_minibatch_iterator(actor, _batch())


# -- driver -------------------------------------------------------------------------------------

def _recipe(*overrides):
    from verl_patches import recipe_config as RC

    return RC.compose("deepseekv3_256die_random_init", list(overrides))


class _StopFit(Exception):
    pass


def _stub_trainer(cfg):
    def _load_checkpoint():
        raise _StopFit  # the real fit() got past its set-up: stop before the loop

    upstream = object()
    wg = types.SimpleNamespace(compute_log_prob=upstream)
    return types.SimpleNamespace(config=cfg, actor_rollout_wg=wg, _load_checkpoint=_load_checkpoint), upstream


def test_driver_skips_the_forward_for_the_recipe_config():
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    cfg = _recipe("trainer.logger=[console]")
    trainer, upstream = _stub_trainer(cfg)
    ap.apply_all(driver_patch.PATCHES[1:])
    try:
        with pytest.raises(_StopFit):
            RayPPOTrainer.fit(trainer)
    finally:
        ap.undo()
    skip = trainer.actor_rollout_wg.compute_log_prob
    assert skip is driver_patch.skipped_compute_log_prob
    # What fit() does with the result (ray_trainer.py, "old_log_prob" block).
    batch = _batch()
    out = skip(batch)
    ent = agg_loss(loss_mat=out.batch["entropys"], loss_mask=batch.batch["attention_mask"][:, -R:], loss_agg_mode="token-mean")
    assert torch.isnan(ent)
    out.batch.pop("entropys")
    merged = batch.union(out)
    assert "old_log_probs" not in merged.batch.keys() and len(merged) == B

    # Unpatched, fit() keeps the upstream worker call.
    trainer, upstream = _stub_trainer(cfg)
    with pytest.raises(_StopFit):
        RayPPOTrainer.fit(trainer)
    assert trainer.actor_rollout_wg.compute_log_prob is upstream


@pytest.mark.parametrize("override,message", [
    ("actor_rollout_ref.actor.ppo_epochs=2", "actor.ppo_epochs=2"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=128", r"data.train_batch_size=512 != actor.ppo_mini_batch_size=128: 4 optimizer"),
    ("algorithm.use_kl_in_reward=True", "use_kl_in_reward=True"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=clip-cov", "loss_mode='clip-cov'"),
])
def test_driver_rejects_invalid_configs(override, message):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer, upstream = _stub_trainer(_recipe("trainer.logger=[console]", override))
    ap.apply_all(driver_patch.PATCHES[1:])
    try:
        with pytest.raises(ValueError, match=message) as e:
            RayPPOTrainer.fit(trainer)
    finally:
        ap.undo()
    assert "recompute_old_log_prob=False (old log-prob reuse) is invalid" in str(e.value)
    assert trainer.actor_rollout_wg.compute_log_prob is upstream


def test_recompute_true_is_upstream():
    cfg = _recipe("actor_rollout_ref.actor.recompute_old_log_prob=True", "actor_rollout_ref.actor.ppo_epochs=2")
    assert not driver_patch.reuse_old_log_prob(cfg)
    assert driver_patch.reuse_old_log_prob(_recipe())


@pytest.mark.parametrize("left_out", [p.id for p in ALL])
def test_each_actor_side_patch_is_needed(left_out):
    subset = [p for p in ALL if p.id != left_out]
    if any(left_out in p.requires for p in subset):
        # Declared: the applier refuses the subset, naming the missing patch.
        with pytest.raises(ap.PatchError, match=left_out.replace(".", r"\.")):
            ap.apply_all(subset)
    # And real: with the declaration dropped by hand, the update fails or gives NaN.
    ap.apply_all([_without_requirement(p, left_out) for p in subset])
    try:
        try:
            loss, _, _ = _update(False, _batch())
        except KeyError as e:  # no placeholder: verl's iterator cannot select old_log_probs
            assert "old_log_probs" in str(e)
            return
    finally:
        ap.undo()
    assert torch.isnan(loss).all()  # the placeholder reached the loss: switch or substitution missing
