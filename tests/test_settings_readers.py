"""One home per setting: a recipe key is declared once (verl_patches/config/settings.py: KEYS, VLLM_DP), read
once as the run's RecipeSettings, and that value reaches every reader the run has, through the
object and the one stash key on vLLM's LLM, never restated.

For each key a value other than its default is written into a trainer config as verl composes it; every
reader of that key must then see exactly that value. A key added to KEYS without a row here fails
``test_every_key_has_its_readers``.

Stand-ins, declared: vLLM's LLM is a bare object carrying the stash (the rollout patch puts the rollout
settings there, ``_check_rebalance`` runs as the rollout's construction runs it); the readers themselves
are the overlay's own functions.
"""

from __future__ import annotations

import types

import pytest
from omegaconf import OmegaConf

from verl_patches.config import settings

WORLD = 4

# A valid value other than the default, for each key.
OTHER = {
    "reshard_method": "alltoallv",
    "reshard_bucket_mb": 64,
    "tensor_cache": False,
    "dp_sync_on_device": False,
    "offload": False,
    "rollout_torch_compile": False,
    "fixed_routing": True,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
    "device_memory_gib": 61.5,
    "host_memory_gib": 1500.0,
    "metrics_file": "run/metrics.jsonl",
    "fingerprint_every": 3,
    "tensorboard_dir": "run/tb",
    "rebalance": True,
    "rebalance_min_graph_size_drop": 2,
    "rebalance_max_imbalance": 1.5,
    "rebalance_cpu_stagger": 5,
    "devices_per_card": 2,
}
OTHER_VLLM_DP = {"dp_size": 2, "instances": 2, "master_port_base": 31000, "port_stride": 8}


def _trainer(section: dict):
    # The rebalance_* keys come with rebalance on: the generation runs them only then (and the rollout
    # refuses the stagger alone). TP1 over 4 ranks.
    if any(k.startswith("rebalance_") for k in section):
        section = {**section, "rebalance": True}
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 1,
                                                               "recipe": section}}})


def _rollout(cfg):
    from verl_patches.rollout.settings import RolloutSettings

    return RolloutSettings.from_config(cfg.actor_rollout_ref.rollout, WORLD)


def _llm(cfg):
    """vLLM's LLM as the rollout patch leaves it: the rollout settings under the one stash key."""
    from verl_patches.core import stash
    from verl_patches.patches.verl.patch_workers_rollout_vllm_rollout_spmd import _check_rebalance
    from verl_patches.rollout.settings import STASH_KEY

    rollout = _rollout(cfg)
    _check_rebalance(rollout.recipe)
    llm = types.SimpleNamespace()
    stash.put(llm, STASH_KEY, rollout)
    return llm


def _from_llm(cfg):
    from verl_patches.core import stash
    from verl_patches.rollout.settings import STASH_KEY

    return stash.get(_llm(cfg), STASH_KEY)


def _policy(cfg):
    from verl_patches.rollout.long_tail.rebalance import RebalancePolicy

    return RebalancePolicy.from_settings(_from_llm(cfg).recipe)


def _generation(cfg):
    from verl_patches.rigs.cpu.engine import rebalance_setup

    return rebalance_setup(_llm(cfg))


def _ddp(cfg, key):
    from verl_patches.train.ddp_overlap import DdpOverlap

    return {getattr(DdpOverlap.from_worker(cfg.actor_rollout_ref), key), getattr(DdpOverlap.from_trainer(cfg), key)}


def _fixed_routing(cfg):
    from verl_patches.train import fixed_routing

    return fixed_routing.configure_from_worker_config(cfg.actor_rollout_ref)


def _patch_reader(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(f"verl_patches.patches.verl.{module}"), name)


class _Built(Exception):
    """Raised by the WeightSync.build stand-in below, carrying what the sharding manager passed it."""


def _bucket_mb_the_plan_gets(cfg):
    """The sharding manager's _build_session as the first switch runs it, up to WeightSync.build: the
    bucket it asks the plan for, in MiB (the plan's own bucket_bytes from that argument:
    tests/patches/verl/test_sharding_manager_reshard.py). Stand-ins: megatron's parallel state, the
    rank, and WeightSync.build itself (it stops there)."""
    from unittest import mock

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from verl_patches.patches.verl.patch_workers_sharding_manager_megatron_vllm import _build_session
    from verl_patches.reshard.weight_sync import WeightSync

    def build(*args, **kwargs):
        raise _Built(kwargs)

    manager = types.SimpleNamespace(model_config=types.SimpleNamespace(to_dict=lambda: {}))
    with mock.patch.object(WeightSync, "build", classmethod(build)), mock.patch.object(dist, "get_rank", lambda: 0), \
            mock.patch.multiple(mpu, get_tensor_model_parallel_world_size=lambda: 1,
                                get_pipeline_model_parallel_world_size=lambda: 1,
                                get_pipeline_model_parallel_rank=lambda: 0):
        with pytest.raises(_Built) as e:
            _build_session(manager, _from_llm(cfg), {}, {})
    bucket = e.value.args[0]["bucket_bytes"]
    assert bucket % (1 << 20) == 0, bucket
    return bucket >> 20


# key -> the readers the run has for it (each: trainer config -> the value it sees).
READERS = {
    "reshard_method": [lambda c: _from_llm(c).recipe.reshard_method],  # the sharding manager's
    "reshard_bucket_mb": [_bucket_mb_the_plan_gets],  # the sharding manager's plan
    "tensor_cache": [lambda c: _patch_reader("patch_trainer_ppo_ray_trainer", "tensor_cache_on")(c)],
    "dp_sync_on_device": [lambda c: _from_llm(c).recipe.dp_sync_on_device],
    "offload": [lambda c: _patch_reader("patch_workers_megatron_workers_switch", "offload_on")(c.actor_rollout_ref),
                lambda c: _from_llm(c).recipe.offload],
    "rollout_torch_compile": [
        lambda c: _patch_reader("patch_workers_megatron_workers_rollout_compile", "rollout_compile_on")(c.actor_rollout_ref)],
    "fixed_routing": [_fixed_routing],
    "overlap_grad_reduce": [lambda c: _ddp(c, "overlap_grad_reduce").pop()],
    "overlap_param_gather": [lambda c: _ddp(c, "overlap_param_gather").pop()],
    # Read at launch by the memory check (verl_patches/checks/recipe_config.py) from the composed YAML, and
    # by nothing in the run: the run's object still carries them.
    "device_memory_gib": [lambda c: settings.from_trainer(c).device_memory_gib],
    "host_memory_gib": [lambda c: settings.from_trainer(c).host_memory_gib],
    # The run report (patch verl.tracking.report builds the trainer's RecipeSettings).
    "metrics_file": [lambda c: settings.from_trainer(c).metrics_file],
    "tensorboard_dir": [lambda c: settings.from_trainer(c).tensorboard_dir],
    "devices_per_card": [lambda c: settings.from_trainer(c).devices_per_card],
    "fingerprint_every": [lambda c: _from_llm(c).recipe.fingerprint_every],  # the sharding manager's self-check
    "rebalance": [lambda c: _policy(c).enabled, lambda c: _generation(c).policy.enabled],
    "rebalance_min_graph_size_drop": [lambda c: _policy(c).min_graph_size_drop, lambda c: _generation(c).policy.min_graph_size_drop],
    "rebalance_max_imbalance": [lambda c: _policy(c).max_imbalance, lambda c: _generation(c).policy.max_imbalance],
    "rebalance_cpu_stagger": [lambda c: _generation(c).stagger],
}


def test_every_key_has_its_readers():
    scalars = {k for k, v in settings.KEYS.items() if v.kind != "section"}
    assert set(READERS) == scalars == set(OTHER)


@pytest.mark.parametrize("key", sorted(OTHER))
def test_a_key_reaches_each_reader(key, monkeypatch):
    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")  # rebalance is the CPU stand-in's
    monkeypatch.delenv("VERL_PATCHES_FIXED_ROUTING", raising=False)
    value = OTHER[key]
    assert value != settings.KEYS[key].default and settings.problem(key, value, key) is None
    cfg = _trainer({key: value})
    assert getattr(settings.from_trainer(cfg), key) == value
    for read in READERS[key]:
        assert read(cfg) == value, (key, read)
    # Absent from the section: every reader sees the declared default (the generation has no
    # rebalance setup at all then: rebalance is off by default).
    default = _trainer({})
    for read in READERS[key]:
        try:
            got = read(default)
        except AttributeError:
            assert _generation(default) is None
            continue
        assert got == settings.KEYS[key].default, (key, read)


def test_the_vllm_dp_keys_reach_the_dp_domain():
    cfg = _trainer({"vllm_dp": OTHER_VLLM_DP})
    dp = _from_llm(cfg).dp
    assert (dp.dp_size, dp.instances, dp.master_port_base, dp.port_stride) == (2, 2, 31000, 8)
    assert all(OTHER_VLLM_DP[k] != v.default for k, v in settings.VLLM_DP.items())
    dp = _from_llm(_trainer({})).dp
    defaults = {k: v.default for k, v in settings.VLLM_DP.items()}
    assert (dp.instances, dp.master_port_base, dp.port_stride) == (defaults["instances"], defaults["master_port_base"],
                                                                   defaults["port_stride"])
    assert dp.dp_size == WORLD  # null: every rank of the instance


def test_the_megatron_section_reaches_the_reshard_plan_and_the_switch():
    cfg = _trainer({"megatron": {"num_layer_list": "3,1", "swap_optimizer": True}})
    assert _from_llm(cfg).num_layer_list == (3, 1)  # the sharding manager's plan
    assert settings.from_worker(cfg.actor_rollout_ref).megatron.swap_optimizer is True


def test_the_object_is_frozen_and_names_every_problem_at_once():
    import dataclasses

    run = settings.build({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.offload = False
    with pytest.raises(settings.SettingsError) as e:
        settings.build({"offload": "no", "fingerprint_every": -1, "ofload": True, "reshard_bucket_mb": 0})
    message = str(e.value)
    assert "recipe.offload must be true or false" in message and "recipe.fingerprint_every must be >= 0" in message \
        and "recipe.ofload: unknown key (did you mean 'offload'?)" in message \
        and "recipe.reshard_bucket_mb must be >= 1 and <= 4096, got 0" in message


def test_the_run_reads_the_section_only_through_the_object():
    """No module but verl_patches/config/settings.py reads a recipe key with settings.read: the run's
    patches and engines take RecipeSettings' attributes (the launch-time validator, recipe_config, judges
    the composed YAML itself, including sections that do not build)."""
    import ast

    from tests.helpers import REPO

    offenders = []
    for path in sorted((REPO / "verl_patches").rglob("*.py")):
        if path.relative_to(REPO).as_posix() == "verl_patches/config/settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "read" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("settings", "overlay_settings"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []
