"""Patch verl.optim.cpu_offload against the real verl 0.4.1 and megatron-core 0.12.1: verl's own
init_megatron_optim_config drops megatron-core's optimizer-offload fields; with the patch they reach
megatron-core's OptimizerConfig (and the precision-aware flag the hybrid optimizer's host masters need);
bad values and MindSpeed's swap optimizer are refused by name. The hybrid optimizer itself needs CUDA
(its split moves CUDA params): tests/offload/test_optimizer_offload_gpu.py steps it on a GPU."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl_patches.core.apply import apply_all, undo
from verl_patches.patches import get_patch
from verl_patches.patches.verl.patch_utils_megatron_utils_switch import OptimizerOffloadError, offload_settings
from verl_patches.patches.verl.patch_workers_megatron_workers_switch import check_optimizer_offload

IDS = ("verl.optim.adam_betas", "verl.optim.cpu_offload")
BASE = {"lr": 1e-6, "adam_beta2": 0.95}


@pytest.fixture
def megatron_utils():
    from verl.utils import megatron_utils

    apply_all([get_patch(i) for i in IDS])
    try:
        yield megatron_utils
    finally:
        undo()


def test_upstream_drops_the_offload_fields():
    from verl.utils import megatron_utils

    cfg = megatron_utils.init_megatron_optim_config({**BASE, "optimizer_cpu_offload": True,
                                                     "optimizer_offload_fraction": 1.0})
    assert cfg.optimizer_cpu_offload is False and cfg.optimizer_offload_fraction == 0.0


def test_the_fields_reach_megatron_cores_config(megatron_utils):
    from megatron.core.optimizer import OptimizerConfig

    cfg = megatron_utils.init_megatron_optim_config({**BASE, "optimizer_cpu_offload": True})
    assert isinstance(cfg, OptimizerConfig)
    assert cfg.optimizer_cpu_offload is True and cfg.optimizer_offload_fraction == 1.0  # default: all of it
    assert cfg.use_precision_aware_optimizer is True and cfg.use_distributed_optimizer is True
    assert cfg.overlap_cpu_optimizer_d2h_h2d is False  # megatron-core's default when not given
    assert cfg.adam_beta2 == 0.95  # the adam_betas wrap still runs beneath
    half = megatron_utils.init_megatron_optim_config({**BASE, "optimizer_cpu_offload": True,
                                                      "optimizer_offload_fraction": 0.5,
                                                      "overlap_cpu_optimizer_d2h_h2d": True})
    assert half.optimizer_offload_fraction == 0.5 and half.overlap_cpu_optimizer_d2h_h2d is True
    # Off (absent or false): upstream's config, untouched.
    for off in ({}, {"optimizer_cpu_offload": False}):
        plain = megatron_utils.init_megatron_optim_config({**BASE, **off})
        assert plain.optimizer_cpu_offload is False and plain.use_precision_aware_optimizer is False
    # Hydra's DictConfig, as verl passes actor.optim.
    dc = megatron_utils.init_megatron_optim_config(OmegaConf.create({**BASE, "optimizer_cpu_offload": True}))
    assert dc.optimizer_cpu_offload is True


@pytest.mark.parametrize("optim, message", [
    ({"optimizer_cpu_offload": "true"}, "must be true or false, got 'true' (write it without quotes)"),
    ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0}, "must be a number in (0, 1]"),
    ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.5}, "must be a number in (0, 1]"),
    ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": True}, "must be a number in (0, 1]"),
    ({"optimizer_cpu_offload": True, "overlap_cpu_optimizer_d2h_h2d": 1}, "overlap_cpu_optimizer_d2h_h2d must be"),
    ({"optimizer_offload_fraction": 0.5}, "optimizer_cpu_offload is not true"),
    ({"optimizer_cpu_offload": True, "optimizer": "lion"}, "needs optimizer adam or sgd"),
])
def test_bad_settings_are_named(megatron_utils, optim, message):
    with pytest.raises(OptimizerOffloadError) as e:
        megatron_utils.init_megatron_optim_config({**BASE, **optim})
    assert message in str(e.value)


def _worker_config(offload: bool, swap: bool):
    return OmegaConf.create({"actor": {"optim": {"lr": 1e-6, **({"optimizer_cpu_offload": True} if offload else {})}},
                             "rollout": {"recipe": {"megatron": {"swap_optimizer": swap}}}})


def test_mindspeeds_swap_optimizer_is_refused_with_it():
    with pytest.raises(OptimizerOffloadError, match="cannot combine with actor_rollout_ref.rollout.recipe.megatron."
                                                    "swap_optimizer=True"):
        check_optimizer_offload(_worker_config(offload=True, swap=True))
    for offload, swap in ((True, False), (False, True), (False, False)):
        check_optimizer_offload(_worker_config(offload, swap))  # either alone is fine


def test_the_settings_reader():
    assert offload_settings({}) is None
    assert offload_settings({"optimizer_cpu_offload": True}) == {"fraction": 1.0, "overlap": None}
    assert offload_settings({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.25}) == \
        {"fraction": 0.25, "overlap": None}
