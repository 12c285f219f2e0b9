"""The rollout settings the patch reads from verl's rollout config: the recipe's defaults and clear errors."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl_patches.rollout.dp_domain import DPDomainError
from verl_patches.rollout.settings import RolloutSettings


def _cfg(**recipe):
    return OmegaConf.create({"tensor_model_parallel_size": 2, "max_num_batched_tokens": 1024,
                             "enable_chunked_prefill": True, "recipe": recipe})


def test_plain_verl_config_gets_the_recipes_defaults():
    s = RolloutSettings.from_config(OmegaConf.create({"tensor_model_parallel_size": 2}), 256)
    assert (s.recipe.offload, s.recipe.dp_sync_on_device) == (True, True)
    assert (s.dp.dp_size, s.dp.tp_size, s.dp.instances, s.dp.master_port_base) == (128, 2, 1, 29600)
    assert s.max_num_batched_tokens == 8192 and s.enable_chunked_prefill


def test_yaml_values_win_and_missing_dp_size_is_derived():
    s = RolloutSettings.from_config(_cfg(offload=False, dp_sync_on_device=False,
                                         vllm_dp={"dp_size": "???", "instances": 2, "master_port_base": 31000}), 256)
    assert (s.recipe.offload, s.recipe.dp_sync_on_device) == (False, False)
    assert (s.dp.dp_size, s.dp.instances, s.dp.master_port_base) == (64, 2, 31000)
    assert s.max_num_batched_tokens == 1024


@pytest.mark.parametrize("recipe,world,error,match", [
    ({"vllm_dp": {"instances": 3}}, 256, DPDomainError, "not divisible by rollout TP2 x 3 instance"),
    ({"offload": "yes"}, 256, ValueError, "recipe.offload must be true or false"),
    ({"vllm_dp": {"dp_size": 64, "instances": 1}}, 256, DPDomainError, "= 128 ranks, but the world has 256"),
])
def test_bad_settings_are_named(recipe, world, error, match):
    with pytest.raises(error, match=match):
        s = RolloutSettings.from_config(_cfg(**recipe), world)
        from verl_patches.rollout.dp_domain import derive_dp_domain

        derive_dp_domain(0, world, s.dp)


def test_token_budget_below_context_needs_chunked_prefill():
    s = RolloutSettings.from_config(_cfg(), 2)
    s.check_batched_tokens(4096)  # the recipe: 1024 with chunked prefill
    off = RolloutSettings.from_config(OmegaConf.merge(_cfg(), {"enable_chunked_prefill": False}), 2)
    with pytest.raises(ValueError, match="needs rollout.enable_chunked_prefill=True"):
        off.check_batched_tokens(4096)
    off.check_batched_tokens(1024)
