"""Old log-prob reuse through verl 0.4.1's real MegatronPPOActor.make_minibatch_iterator and
update_policy bodies and its real compute_policy_loss: same loss and gradients as the recomputed
path, invalid configurations rejected on the driver and on the worker.

The Megatron model is the only stand-in (a one-layer torch policy on CPU, since a Megatron GPT needs
a device): forward_backward_batch looks its forward function up per micro-batch as verl's
forward_step does (verl.models.mcore.get_mcore_forward_fn, whose registry entry is the stand-in
forward over that policy), computes log-probs with it and calls the loss exactly as verl's loss_func
does (the module-level compute_policy_loss name of megatron_actor, same arguments). The entropy's
tensor-parallel collective is a plain torch entropy here (TP 1, no process group); the real update
with verl's forward_backward_batch runs in test_rollout_mismatch.py.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from omegaconf import OmegaConf

from verl_patches.core import apply as ap
from verl_patches.train.mismatch import MismatchError
from verl_patches.patches.verl import patch_models_mcore_registry as forward_patch
from verl_patches.patches.verl import patch_trainer_ppo_core_algos as loss_patch
from verl_patches.train.old_log_prob import reusing_old_log_prob
from verl_patches.patches.verl import patch_trainer_ppo_ray_trainer as driver_patch
from verl_patches.patches.verl import patch_workers_actor_megatron_actor as actor_patch

B, P, R, V, H = 6, 3, 5, 11, 4  # sequences, prompt, response, vocab, hidden
ENTROPY_PATCH = [p for p in forward_patch.PATCHES if p.id == "verl.old_log_prob.entropy"]
ALL = loss_patch.PATCHES + actor_patch.PATCHES + ENTROPY_PATCH
HF = types.SimpleNamespace(architectures=["DeepseekV3ForCausalLM"])


def _without_requirement(patch, dep):
    return dataclasses.replace(patch, requires=tuple(r for r in patch.requires if r != dep))


@pytest.fixture
def patched():
    ap.apply_all(ALL)
    yield
    ap.undo()


def _batch(seed=0, rollout=False):
    """``rollout``: with the rollout's log-probs (rollout.calculate_log_probs=True): the policy's own
    plus a perturbation, -1 beyond the response as verl pads them."""
    from verl.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (B, P + R), generator=g)
    attention_mask = torch.ones(B, P + R, dtype=torch.int64)
    attention_mask[0, -2:] = 0  # a short response: the mask must matter
    tensors = {
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": torch.arange(P + R).expand(B, -1).clone(),
        "responses": input_ids[:, -R:].clone(),
        "advantages": torch.randn(B, R, generator=g),
    }
    if rollout:
        with torch.no_grad():
            lp = Policy().log_prob(input_ids, tensors["responses"])
        lp = lp + 0.3 * torch.randn(B, R, generator=g)
        tensors["rollout_log_probs"] = lp.masked_fill(attention_mask[:, -R:] == 0, -1.0)
    return DataProto.from_dict(tensors=tensors, meta_info={"micro_batch_size": 2})


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.emb = torch.nn.Parameter(torch.randn(V, H, generator=g))
        self.out = torch.nn.Parameter(torch.randn(H, V, generator=g))

    def logits(self, input_ids):
        return torch.tanh(self.emb[input_ids]) @ self.out  # position t scores token t + 1

    def log_prob(self, input_ids, responses):
        logits = self.logits(input_ids)[:, -R - 1:-1]
        return torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def _standin_forward(model, input_ids, attention_mask=None, position_ids=None, sequence_parallel=False,
                     logits_processor=None, logits_processor_args=None, **_):
    """The registry's forward function for the stand-in policy: logits [B, S, V] to the processor."""
    return logits_processor(model.logits(input_ids), **(logits_processor_args or {}))


def _log_probs_processor(logits, label):
    return {"log_probs": torch.log_softmax(logits, -1).gather(-1, label.unsqueeze(-1)).squeeze(-1)}


def _entropy_tp1(logits):
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.fixture(autouse=True)
def _standin_model_forward(monkeypatch):
    from verl.models.mcore import registry
    from verl.utils.megatron import tensor_parallel

    monkeypatch.setitem(registry.MODEL_FORWARD_REGISTRY, registry.SupportedModel.DEEPSEEK_V3, _standin_forward)
    monkeypatch.setattr(tensor_parallel, "vocab_parallel_entropy", _entropy_tp1)


def _standin_forward_backward_batch(self, data, forward_only=False, **_):
    """MegatronPPOActor.forward_backward_batch for the stand-in policy (installed as the class's
    method before the patches wrap it): verl's forward_step and loss_func per micro-batch of 2."""
    import verl.workers.actor.megatron_actor as ma
    from verl.models.mcore import get_mcore_forward_fn

    losses = []
    for micro in data.batch.split(2):
        label = micro["position_ids"].clone()
        label[:, -R - 1:-1] = micro["responses"]
        forward_fn = get_mcore_forward_fn(HF)  # looked up per micro-batch, as in verl's forward_step
        out = forward_fn(self.policy, micro["input_ids"], logits_processor=_log_probs_processor,
                         logits_processor_args={"label": label})
        log_prob = out["log_probs"][:, -R - 1:-1]
        mask = micro["attention_mask"][:, -R:].bool()
        # The call verl's loss_func makes (megatron_actor.py, vanilla loss mode).
        pg_loss, clipfrac, ppo_kl, _ = ma.compute_policy_loss(
            old_log_prob=micro["old_log_probs"], log_prob=log_prob, advantages=micro["advantages"],
            response_mask=mask, cliprange=0.2, cliprange_low=0.2, cliprange_high=0.2, clip_ratio_c=3.0,
            loss_agg_mode="token-mean")
        pg_loss.backward()
        self.seen["loss"].append(pg_loss.detach())
        self.seen["stats"].append((clipfrac.detach(), ppo_kl.detach()))
        losses.append([{}, None])
    return {"output": losses}  # one loss output per micro-batch, as Megatron's schedule returns


@pytest.fixture(autouse=True)
def _standin_forward_backward(monkeypatch):
    # Before any patch: the patches then wrap the stand-in as they wrap verl's method (autouse
    # fixtures are set up before the `patched` fixture).
    import verl.workers.actor.megatron_actor as ma

    monkeypatch.setattr(ma.MegatronPPOActor, "forward_backward_batch", _standin_forward_backward_batch)


def _actor(policy, recompute: bool, mini=B, epochs=1):
    """An object carrying what the real update_policy / make_minibatch_iterator bodies read."""
    import verl.workers.actor.megatron_actor as ma

    cfg = OmegaConf.create({
        "ppo_mini_batch_size": mini, "ppo_epochs": epochs, "data_loader_seed": 0, "shuffle": False,
        "use_kl_loss": False, "entropy_coeff": 0, "ppo_micro_batch_size_per_gpu": 2, "use_dynamic_bsz": False,
        "recompute_old_log_prob": recompute, "clip_ratio": 0.2, "loss_agg_mode": "token-mean",
    })
    seen = {"loss": [], "stats": [], "steps": 0}

    def step():
        seen["steps"] += 1
        return True, 0.0, None

    opt = types.SimpleNamespace(zero_grad=lambda: None, step=step)
    prof = types.SimpleNamespace(start=lambda: None, step=lambda: None, stop_and_save=lambda: None,
                                 stop_trace=lambda: None)
    actor = types.SimpleNamespace(config=cfg, actor_optimizer=opt, actor_module=[], prof=prof, policy=policy, seen=seen)
    # The class's method as it is now (the stand-in, wrapped by whatever patches are applied).
    actor.forward_backward_batch = lambda *a, **k: ma.MegatronPPOActor.forward_backward_batch(actor, *a, **k)
    return actor, seen


def _update(recompute: bool, data):
    import verl.workers.actor.megatron_actor as ma

    policy = Policy()
    actor, seen = _actor(policy, recompute)
    if recompute:  # the separate old-log-prob forward the reuse skips
        # Per micro-batch of the update's size (2 rows, in order, as verl's compute_log_prob splits
        # with the same micro-batch size): the same shapes as the update's own forward, so the same
        # kernels and reduction order on any CPU.
        micro = int(actor.config.ppo_micro_batch_size_per_gpu)
        with torch.no_grad():
            data.batch["old_log_probs"] = torch.cat([
                policy.log_prob(ids, resp) for ids, resp in zip(data.batch["input_ids"].split(micro),
                                                                 data.batch["responses"].split(micro))])
    loader = ma.MegatronPPOActor.make_minibatch_iterator(actor, data)
    metrics = ma.MegatronPPOActor.update_policy(actor, loader)
    seen["metrics"] = metrics
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
    # Tolerance: exact (rtol=atol=0). Here the recomputed old log-prob comes from the same forward on
    # the same micro-batch shapes (_update), so log_prob - old_log_prob is exactly 0 on both paths, on
    # any CPU; on a device verl's recompute may run other micro-batch shapes and differ in the last
    # bits, which is the reuse's point.
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
    # The requirement is real (the declaration dropped by hand): without the substitution the
    # micro-batch check stops the update before the optimizer step, and without that check too the
    # NaN placeholder reaches the loss.
    ap.apply_all([_without_requirement(p, "verl.old_log_prob.policy_loss") for p in actor_patch.PATCHES])
    try:
        with pytest.raises(MismatchError, match="0 went through the substitution"):
            _update(False, _batch())
    finally:
        ap.undo()
    ap.apply_all([dataclasses.replace(p, requires=()) for p in actor_patch.PATCHES
                  if p.id != "verl.old_log_prob.micro_batch_check"])
    try:
        loss, _, _ = _update(False, _batch())
    finally:
        ap.undo()
    assert torch.isnan(loss).all()


def _direct_mismatch(data):
    """What the metrics must be, straight from the stand-in policy's logits (the update's forward)."""
    from verl.trainer.ppo.core_algos import agg_loss

    policy = Policy()
    with torch.no_grad():
        a = policy.log_prob(data.batch["input_ids"], data.batch["responses"])
        logp = torch.log_softmax(policy.logits(data.batch["input_ids"])[:, -R - 1:-1], -1)
        ent = -(logp.exp() * logp).sum(-1)
    m = data.batch["attention_mask"][:, -R:].bool()
    r = data.batch["rollout_log_probs"]
    pd = (a.exp() - r.exp()).abs()[m]
    d = (a - r)[m]
    return {"training/rollout_probs_diff_mean": pd.mean(), "training/rollout_probs_diff_max": pd.max(),
            "training/rollout_probs_diff_std": pd.std(), "training/rollout_logprob_abs_diff_mean": d.abs().mean(),
            "training/rollout_logprob_abs_diff_max": d.abs().max(), "training/rollout_kl_k3": (d.exp() - 1 - d).mean(),
            "actor/entropy": agg_loss(loss_mat=ent, loss_mask=m.float(), loss_agg_mode="token-mean")}


def test_with_the_rollout_log_probs_same_update_and_the_mismatch_metrics(patched):
    ref_loss, _, ref_grads = _update(True, _batch())
    data = _batch(rollout=True)
    want = _direct_mismatch(data)
    policy = Policy()
    actor, seen = _actor(policy, recompute=False)
    import verl.workers.actor.megatron_actor as ma

    metrics = ma.MegatronPPOActor.update_policy(actor, ma.MegatronPPOActor.make_minibatch_iterator(actor, data))
    # The rollout's log-probs reached the loss as old_log_probs and were replaced there: the update is
    # the recomputed path's, exactly (same tolerance argument as above).
    torch.testing.assert_close(torch.stack(seen["loss"]), ref_loss, rtol=0, atol=0)
    for p, rg in zip(policy.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, rg, rtol=0, atol=0)
    assert seen["steps"] == 1
    got = {k: v[0] for k, v in metrics.items() if k in want}
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(float(v), rel=1e-5, abs=1e-7), k
    assert got["training/rollout_kl_k3"] > 0 and got["training/rollout_logprob_abs_diff_max"] > 0.1


def test_the_micro_batch_check_stops_a_silently_wrong_update():
    """With the rollout's log-probs in old_log_probs a missed substitution is no longer NaN: without the
    check the update trains on the rollout's log-prob as the old one; with it, it stops before the
    optimizer step, naming the patch."""
    subset = [dataclasses.replace(p, requires=()) for p in actor_patch.PATCHES if p.id != "verl.old_log_prob.micro_batch_check"]
    ap.apply_all(subset)
    try:
        loss, stats, _ = _update(False, _batch(rollout=True))
    finally:
        ap.undo()
    assert torch.isfinite(loss).all() and any(float(k) != 0.0 for _, k in stats)  # ratio != 1: wrong, silently
    ap.apply_all([dataclasses.replace(p, requires=()) for p in actor_patch.PATCHES])
    try:
        policy = Policy()
        actor, seen = _actor(policy, recompute=False)
        import verl.workers.actor.megatron_actor as ma

        loader = ma.MegatronPPOActor.make_minibatch_iterator(actor, _batch(rollout=True))
        with pytest.raises(MismatchError, match=r"3 micro-batch loss\(es\) ran but 0 went through the substitution "
                                                r"\(patch verl\.old_log_prob\.policy_loss\)"):
            ma.MegatronPPOActor.update_policy(actor, loader)
    finally:
        ap.undo()
    assert seen["steps"] == 0


def test_reuse_only_inside_the_update(patched):
    import verl.trainer.ppo.core_algos as ca

    lp = torch.zeros(1, 2, requires_grad=True)
    old = torch.full((1, 2), -1.0)
    out = ca.compute_policy_loss(old, lp, torch.ones(1, 2), torch.ones(1, 2), cliprange=0.2)
    assert float(out[2]) == pytest.approx(-1.0)  # ppo_kl = mean(old - new): the given old log-prob is used
    with reusing_old_log_prob():
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
    from verl_patches.checks import recipe_config as RC

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
    # The recipe asks the rollout for its log-probs with reuse on: accepted (the update compares them).
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True and driver_patch.reuse_old_log_prob(cfg)
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

    # With the rollout's log-probs on the host (no TensorCache) the trainer's own comparison reads
    # old_log_probs: it gets NaN (not computed here; the update's figures replace its metrics), never
    # a copy of the rollout's that would read as zero mismatch.
    batch = _batch(rollout=True)
    out = skip(batch)
    assert torch.isnan(out.batch["old_log_probs"]).all() and out.batch["old_log_probs"].shape == (B, R)
    out.batch.pop("entropys")
    merged = batch.union(out)
    assert torch.equal(merged.batch["rollout_log_probs"], batch.batch["rollout_log_probs"])

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
    if left_out == "verl.old_log_prob.micro_batch_check":
        return  # a guard: what it stops is in test_the_micro_batch_check_stops_a_silently_wrong_update
    # And real: with the declaration dropped by hand, the update fails or gives NaN.
    ap.apply_all([_without_requirement(p, left_out) for p in subset])
    try:
        try:
            loss, _, _ = _update(False, _batch())
        except KeyError as e:  # no placeholder: verl's iterator cannot select old_log_probs
            assert "old_log_probs" in str(e)
            return
        except MismatchError as e:  # the update's own checks name the missing patch
            assert left_out in str(e)
            return
    finally:
        ap.undo()
    assert torch.isnan(loss).all()  # the placeholder reached the loss: switch or substitution missing


def test_the_update_reports_its_split(patched):
    # The stand-in splits 6 rows into micro-batches of 2 (meta_info micro_batch_size, as verl's update reads it).
    import verl.workers.actor.megatron_actor as ma

    actor, _ = _actor(Policy(), recompute=False)
    metrics = ma.MegatronPPOActor.update_policy(actor, ma.MegatronPPOActor.make_minibatch_iterator(actor, _batch()))
    # 8 tokens per row, 6 in row 0 (its response is 2 short): micro-batches of 14, 16, 16 tokens.
    assert {k: metrics[k] for k in ("actor/micro_batches", "actor/micro_batch_rows_min", "actor/micro_batch_rows_max",
                                    "actor/micro_batch_tokens_max")} == {
        "actor/micro_batches": [3.0], "actor/micro_batch_rows_min": [2.0], "actor/micro_batch_rows_max": [2.0],
        "actor/micro_batch_tokens_max": [16.0]}


@pytest.mark.parametrize("arguments, out, message", [
    (dict(use_dynamic_bsz=True), {"output": []}, "returned no micro-batch indices"),
    (dict(use_dynamic_bsz=True), {"output": [], "indices": [[0, 1], [1, 2, 3, 4]]}, "do not cover the 6 rows"),
    (dict(use_dynamic_bsz=False, micro_batch_size=None), {"output": []}, "cannot tell how the update split"),
])
def test_a_split_the_probe_cannot_read_is_refused_by_name(arguments, out, message):
    from verl_patches.train.mismatch import UpdateProbe

    probe = UpdateProbe(False, "token-mean")
    with pytest.raises(MismatchError, match=message):
        actor_patch._note_split(probe, dict(arguments, data=_batch()), out)
