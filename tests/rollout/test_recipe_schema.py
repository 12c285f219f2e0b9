"""The recipe's own keys (actor_rollout_ref.rollout.recipe) against their schema: the shipped
configs pass, and a misspelt key, a wrong type or a string boolean is an error naming the key,
both in the validator the launchers run and where the workers read the section (finding 8)."""

from __future__ import annotations

import pytest

from verl_patches.rollout.settings import RolloutSettings
from verl_patches.config.settings import SCHEMA as RECIPE_SCHEMA
from verl_patches.config.settings import plain
from verl_patches.config.settings import problems as recipe_problems


@pytest.mark.parametrize("name", ["deepseekv3_256die_random_init", "deepseekv3_256die_true_weight"])
def test_the_shipped_configs_match_the_schema(name):
    from verl_patches.checks.recipe_config import RECIPE_SECTION, _select, compose

    cfg = compose(name)
    assert recipe_problems(_select(cfg, RECIPE_SECTION)) == []
    # Every key of the schema is set by the shipped YAML: the schema and the YAML list the same keys.
    section = plain(_select(cfg, RECIPE_SECTION))
    assert set(section) == set(RECIPE_SCHEMA)
    assert set(section["vllm_dp"]) == set(RECIPE_SCHEMA["vllm_dp"])


@pytest.mark.parametrize("section, message", [
    ({"ofload": True}, "recipe.ofload: unknown key (did you mean 'offload'?)"),
    ({"zzz": 1}, "recipe.zzz: unknown key (known: device_memory_gib, devices_per_card, dp_sync_on_device, fingerprint_every, fixed_routing"),
    ({"offload": "false"}, "recipe.offload must be true or false, got the string 'false' (write true or false"),
    ({"offload": 1}, "recipe.offload must be true or false, got 1 (int)"),
    ({"vllm_dp": {"dp_size": "8"}}, "recipe.vllm_dp.dp_size must be an integer, got the string '8'"),
    ({"vllm_dp": {"instances": 0}}, "recipe.vllm_dp.instances must be >= 1, got 0"),
    ({"vllm_dp": {"master_port_base": 70000}}, "master_port_base must be >= 1 and <= 65535, got 70000"),
    ({"vllm_dp": {"dp_sise": 8}}, "recipe.vllm_dp.dp_sise: unknown key (did you mean 'dp_size'?)"),
    ({"vllm_dp": 8}, "recipe.vllm_dp must be a mapping, got 8 (int)"),
    ({"reshard_method": "Direct"}, "reshard_method must be one of ['direct', 'alltoallv', 'upstream']"),
    ({"reshard_bucket_mb": 0}, "recipe.reshard_bucket_mb must be >= 1 and <= 4096, got 0"),
    ({"reshard_bucket_mb": 8192}, "recipe.reshard_bucket_mb must be >= 1 and <= 4096, got 8192"),
    ({"reshard_bucket_mb": 0.5}, "recipe.reshard_bucket_mb must be an integer, got 0.5 (float)"),
    ({"reshard_bucket_mb": "512"}, "recipe.reshard_bucket_mb must be an integer, got the string '512'"),
    ({"megatron": {"swap_optimiser": True}}, "unknown key(s) ['swap_optimiser']"),
])
def test_the_workers_refuse_a_malformed_section(section, message):
    with pytest.raises(ValueError) as e:
        RolloutSettings.from_config({"tensor_model_parallel_size": 1, "recipe": section}, 8)
    assert message in str(e.value)


def test_missing_values_and_nulls_are_left_to_the_layout_checks():
    assert recipe_problems({"vllm_dp": {"dp_size": "???", "instances": None}, "offload": None}) == []
    s = RolloutSettings.from_config({"tensor_model_parallel_size": 2, "recipe": {"vllm_dp": {"dp_size": "???"}}}, 8)
    assert s.dp.dp_size == 4
