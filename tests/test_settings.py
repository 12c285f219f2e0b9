"""The recipe's settings reader: each key's default written once, booleans read one way, unknown keys
and wrong types named, and the same answer from a DictConfig as verl builds it or a plain mapping."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl_patches import settings
from verl_patches.reshard.methods import METHODS
from verl_patches.rollout.settings import RECIPE_SCHEMA


def test_defaults_come_from_one_table_and_absent_sections_take_them():
    for key, spec in settings.KEYS.items():
        assert settings.read(None, key) == spec.default
        assert settings.read({}, key) == spec.default
    assert settings.KEYS["reshard_method"].kind == METHODS
    # The YAML validator checks the same types.
    assert all(RECIPE_SCHEMA[k] == v.kind for k, v in settings.KEYS.items() if v.kind != "section")


def test_from_a_dictconfig_as_verl_builds_it():
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"recipe": {
        "offload": False, "reshard_method": "upstream", "fixed_routing": "???"}}}})
    assert settings.from_trainer(cfg, "offload") is False
    assert settings.from_worker(cfg.actor_rollout_ref, "offload") is False
    assert settings.from_rollout(cfg.actor_rollout_ref.rollout, "reshard_method") == "upstream"
    assert settings.from_trainer(cfg, "tensor_cache") is True  # absent: the default
    assert settings.from_trainer(cfg, "fixed_routing") is False  # '???' (to be set by the run): the default


@pytest.mark.parametrize("key,value,expected", [
    ("offload", "false", "actor_rollout_ref.rollout.recipe.offload must be true or false, got 'false' "
                         "(write true or false without quotes)"),
    ("offload", 1, "must be true or false, got 1"),
    ("reshard_method", "fast", "must be one of ['direct', 'recipe', 'upstream'], got 'fast'"),
    ("device_memory_gib", "64", "must be a number"),
    ("metrics_file", 3, "must be str"),
])
def test_a_wrong_type_is_an_error_naming_the_key(key, value, expected):
    with pytest.raises(settings.SettingsError) as e:
        settings.read({key: value}, key)
    assert expected in str(e.value)


def test_an_unknown_key_is_named_with_the_known_ones():
    with pytest.raises(settings.SettingsError, match=r"recipe.offlaod: unknown key \(known: .*offload"):
        settings.read({}, "offlaod")
