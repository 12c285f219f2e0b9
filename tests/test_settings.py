"""The recipe's settings reader: each key's default written once, booleans read one way, unknown keys
and wrong types named, and the same answer from a DictConfig as verl builds it or a plain mapping."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl_patches.config import settings
from verl_patches.config.settings import METHODS


def test_defaults_come_from_one_table_and_absent_sections_take_them():
    for key, spec in settings.KEYS.items():
        assert settings.read(None, key) == spec.default
        assert settings.read({}, key) == spec.default
    assert settings.KEYS["reshard_method"].kind == METHODS
    # The YAML validator checks the same types (one table).
    assert all(settings.SCHEMA[k] == v.kind for k, v in settings.KEYS.items() if v.kind != "section")


def test_from_a_dictconfig_as_verl_builds_it():
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"recipe": {
        "offload": False, "reshard_method": "upstream", "fixed_routing": "???"}}}})
    assert settings.from_trainer(cfg).offload is False
    assert settings.from_worker(cfg.actor_rollout_ref).offload is False
    assert settings.from_rollout(cfg.actor_rollout_ref.rollout).reshard_method == "upstream"
    assert settings.from_trainer(cfg).tensor_cache is True  # absent: the default
    assert settings.from_trainer(cfg).fixed_routing is False  # '???' (to be set by the run): the default


@pytest.mark.parametrize("key,value,expected", [
    ("offload", "false", "actor_rollout_ref.rollout.recipe.offload must be true or false, got the string "
                         "'false' (write true or false without quotes)"),
    ("offload", 1, "must be true or false, got 1 (int)"),
    ("reshard_method", "fast", "must be one of ['direct', 'alltoallv', 'upstream'], got the string 'fast'"),
    ("device_memory_gib", "64", "must be a positive number"),
    ("metrics_file", 3, "must be a string (a path), got 3 (int)"),
    # The validator's rule at run time too (they disagreed: the run-time reader took any number).
    ("device_memory_gib", -1, "must be a positive number, got -1 (int)"),
    ("host_memory_gib", 0.0, "must be a positive number, got 0.0 (float)"),
    ("devices_per_card", -2, "must be >= 0, got -2"),
])
def test_a_wrong_type_is_an_error_naming_the_key(key, value, expected):
    with pytest.raises(settings.SettingsError) as e:
        settings.read({key: value}, key)
    assert expected in str(e.value)


def test_an_unknown_key_is_named_with_the_known_ones():
    with pytest.raises(settings.SettingsError, match=r"recipe.offlaod: unknown key \(known: .*offload"):
        settings.read({}, "offlaod")


VALUES = [None, "???", True, False, 0, 1, -1, 2, 0.0, 0.5, 1.0, 2.5, -3.0, "x", "false", "direct", "upstream", [1], {}]


@pytest.mark.parametrize("key", sorted(k for k, v in settings.KEYS.items() if v.kind != "section"))
def test_the_run_time_reader_and_the_validator_agree_on_every_value(key):
    """One set of rules: read() refuses a value exactly when problems() names it, with the same words."""
    for value in VALUES:
        found = settings.problems({key: value})
        try:
            settings.read({key: value}, key)
        except settings.SettingsError as e:
            assert found == [str(e)], (key, value)
        else:
            assert found == [], (key, value)


def test_problems_names_unknown_keys_and_the_vllm_dp_section():
    assert settings.problems(None) == [] and settings.problems({}) == []
    assert settings.problems(3) == ["actor_rollout_ref.rollout.recipe must be a mapping of the recipe's keys, got 3 (int)"]
    assert settings.problems({"ofload": True}, "r") == ["r.ofload: unknown key (did you mean 'offload'?)"]
    assert settings.problems({"vllm_dp": {"port_stride": 0, "instances": "???"}}, "r") == \
        ["r.vllm_dp.port_stride must be >= 1, got 0"]


def test_read_unchecked_takes_the_default_and_refuses_an_unknown_key():
    assert settings.read({"offload": "yes"}, "offload", check=False) == "yes"
    assert settings.read({}, "offload", check=False) is True
    with pytest.raises(settings.SettingsError, match="unknown key"):
        settings.read({}, "offlaod", check=False)


def test_check_type_for_verl_keys_has_no_bound():
    assert settings.check_type(int, -3, "rollout.x") == -3
    with pytest.raises(settings.SettingsError, match="rollout.x must be an integer, got the string '3'"):
        settings.check_type(int, "3", "rollout.x")
