"""TensorCache bindings against verl 0.4.1: the real ActorRolloutRefWorker step bodies and
RayPPOTrainer.init_workers, with the overlay's driver and worker wrappers.

- Two gloo ranks run generate -> (reorder) -> reference -> update through the real worker bodies:
  the update gets bit-identical inputs with and without the cache, while the driver sends the
  later stages only row ids and advantages. Without the worker patches the driver stops with a
  message naming them.
- RayPPOTrainer.init_workers (its real body, resource manager and worker-group class stubbed)
  installs the driver wrappers only when patched and the flag is on, and rejects what it cannot serve.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tc_binding_rank  # noqa: E402

from verl_patches.core import apply as ap  # noqa: E402
from verl_patches.patches.verl import patch_trainer_ppo_ray_trainer as driver  # noqa: E402
from verl_patches.tensor_cache.protocol import ROW_KEY  # noqa: E402
from verl_patches.launch.local_ranks import run_distributed  # noqa: E402

# Multi-process or Ray: the slow tier (README: fast tier = -m 'not slow').
pytestmark = pytest.mark.slow


@pytest.mark.slow
def test_real_worker_bodies_cache_on_equals_off_and_sends_only_host_fields():
    res = run_distributed(tc_binding_rank.all_modes, 2, timeout=300)
    mode = lambda name: [r[name] for r in res]  # noqa: E731
    for off, on in (("off", "on"), ("off_recompute", "on_recompute")):
        assert all("digest" in r for r in mode(off) + mode(on)), (mode(off), mode(on))
        assert mode(off)[0]["digest"] == mode(off)[1]["digest"]
        # Every rank's update got bit-identical inputs with and without the cache.
        assert [r["digest"] for r in mode(on)] == [r["digest"] for r in mode(off)]
    assert mode("on_recompute")[0]["entropy"] == mode("off_recompute")[0]["entropy"]
    # The rollout's log-probs reach the update from the cache (in the digests above: bit-identical).
    assert all("rollout_log_probs" in r["update_keys"] for r in mode("on") + mode("on_recompute"))
    sent_off, sent_on, sent_re = mode("off")[0]["sent"], mode("on")[0]["sent"], mode("on_recompute")[0]["sent"]
    assert {"input_ids", "position_ids", "responses", "attention_mask"} <= set(sent_off["update_actor"])
    assert sent_on["compute_ref_log_prob"] == [ROW_KEY] and sent_re["compute_log_prob"] == [ROW_KEY]
    assert sent_on["update_actor"] == sent_re["update_actor"] == sorted([ROW_KEY, "advantages"])
    assert mode("on")[0]["host_keys"] == sorted(["prompts", "responses", "attention_mask", ROW_KEY])
    # Without the worker patches the workers ignore the request and the driver says what is missing.
    assert all("worker-side patches (verl.tensor_cache.*) are not applied" in r["error"] for r in mode("unpatched"))
    # Each worker patch is needed: leaving any one out breaks the cached step.
    from verl_patches.patches.verl import patch_workers_megatron_workers_tensor_cache as workers

    for p in workers.PATCHES:
        if p.id.startswith("verl.tensor_cache."):
            assert all("error" in r for r in mode(f"without {p.id}")), p.id


# -- init_workers ---------------------------------------------------------------------------------

class _WG:
    def __init__(self, name):
        self.name = name
        self.world_size = 2
        for m in ("generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor"):
            setattr(self, m, getattr(self, "_up"))

    def _up(self, data):
        return ("upstream", self.name)

    def init_model(self):
        pass


def _trainer(cfg, critic=False):
    from verl.trainer.ppo.ray_trainer import Role

    pool = object()
    spawned = {"actor_rollout": _WG("actor_rollout"), "ref": _WG("ref")}

    class WGDict:
        def __init__(self, **kw):
            pass

        def spawn(self, prefix_set):
            return {k: spawned[k] for k in prefix_set if k in spawned}

    return types.SimpleNamespace(
        config=cfg, hybrid_engine=True, use_critic=critic, use_reference_policy=True, use_rm=False,
        ref_in_actor=False, device_name="cpu", ray_worker_group_cls=WGDict,
        role_worker_mapping={Role.ActorRollout: object, Role.RefPolicy: object},
        resource_pool_manager=types.SimpleNamespace(create_resource_pool=lambda: None, resource_pool_dict={"p": pool},
                                                    get_resource_pool=lambda role: pool),
    )


@pytest.fixture
def stub_colocation(monkeypatch):
    import verl.trainer.ppo.ray_trainer as rt

    # create_colocated_worker_cls builds a Ray actor class from real worker classes; not needed here.
    monkeypatch.setattr(rt, "create_colocated_worker_cls", lambda class_dict: class_dict)
    monkeypatch.setattr(rt, "RayClassWithInitArgs", lambda cls, **kw: (cls, kw))


def _recipe(*overrides):
    from verl_patches.checks import recipe_config as RC

    return RC.compose("deepseekv3_256die_random_init", list(overrides))


def test_init_workers_installs_the_driver_wrappers(stub_colocation):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    t = _trainer(_recipe())
    RayPPOTrainer.init_workers(t)  # unpatched: upstream methods stay
    assert t.actor_rollout_wg.generate_sequences == t.actor_rollout_wg._up

    ap.apply_all(driver.PATCHES[:1])
    try:
        t = _trainer(_recipe())
        RayPPOTrainer.init_workers(t)
        wg, ref = t.actor_rollout_wg, t.ref_policy_wg
        assert wg.generate_sequences.__name__ == "generate_sequences" and wg.generate_sequences != wg._up
        assert wg.update_actor.__name__ == "stage" and ref.compute_ref_log_prob.__name__ == "stage"
        assert isinstance(t.tensor_cache_state, driver.DriverCacheState)
        # Before any cached generation, stage calls reach the workers unchanged.
        assert ref.compute_ref_log_prob("batch") == ("upstream", "ref")

        t = _trainer(_recipe("actor_rollout_ref.rollout.recipe.tensor_cache=False"))
        RayPPOTrainer.init_workers(t)
        assert t.actor_rollout_wg.update_actor == t.actor_rollout_wg._up  # flag off: upstream

        with pytest.raises(ValueError, match="tensor_cache=True is not supported with:\n  - a critic"):
            RayPPOTrainer.init_workers(_trainer(_recipe(), critic=True))
    finally:
        ap.undo()


def test_flag_defaults_to_the_recipe_value():
    from omegaconf import OmegaConf

    assert driver.tensor_cache_on(OmegaConf.create({}))  # key absent: recipe default (on)
    assert driver.tensor_cache_on(_recipe())
    assert not driver.tensor_cache_on(_recipe("actor_rollout_ref.rollout.recipe.tensor_cache=False"))
