"""The recipe's hand-over to the real MindSpeed release the lock pins (v2.2.0_core_r0.12.1), on CPU.

Skipped where MindSpeed is not installed (scripts/install_upstream_sources.sh found neither the release archive
nor the git tag). MindSpeed's argument parser, its features manager and its feature classes are the
real ones. One declared stand-in: an empty ``torch_npu`` with ``torch_npu.contrib.transfer_to_npu``, which
exist only on Ascend; mindspeed.megatron_adaptor imports the latter at its top, and from
v2.2.0_core_r0.12.1 the features manager's package imports ``torch_npu`` too (its fused_moe_permute
feature, at module level; nothing of it is called at import). The
adaptor is imported under MindSpeed's own NoExecuteFunction, so its import-time patch_features() (the
NPU kernels) does not run and get_mindspeed_args() is the release's own function (mindspeed/args_utils.py,
which the adaptor imports by name).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mindspeed") is None,
                                reason="MindSpeed not installed (scripts/install_upstream_sources.sh: no archive, no git tag)")

from verl_patches.rollout import compile_context as cc  # noqa: E402
from verl_patches.config import megatron_args as ma  # noqa: E402
from verl_patches.core import apply as ap  # noqa: E402
from verl_patches.core.doctor import check_component, check_patch  # noqa: E402
from verl_patches.core.lock import load_lock  # noqa: E402
from verl_patches.patches.mindspeed.patch_arguments import PATCHES  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
COMMON = REPO / "configs" / "deepseekv3_256die_common.yaml"


def recipe_megatron(**changes) -> ma.RecipeMegatron:
    section = OmegaConf.to_container(OmegaConf.load(COMMON).actor_rollout_ref.rollout.recipe.megatron)
    section.update(changes)
    return ma.parse(section)


@pytest.fixture(autouse=True)
def forget_mindspeed_modules():
    # Other tests in this process decide by "mindspeed" in sys.modules (MindSpeed loaded = Ascend run).
    # Each test imports MindSpeed afresh: a test that ran before it in this process may have left part of
    # it imported (an import of mindspeed.features_manager that failed on torch_npu, say, keeps the
    # submodules imported before the failure, with an empty feature list); those are set aside and put back.
    def ours(name):
        return name == "mindspeed" or name.startswith("mindspeed.")

    earlier = {name: sys.modules.pop(name) for name in [n for n in sys.modules if ours(n)]}
    yield
    for name in [n for n in sys.modules if ours(n)]:
        del sys.modules[name]
    sys.modules.update(earlier)


@pytest.fixture
def torch_npu_stand_in(monkeypatch):
    """Declared stand-in: an empty torch_npu package (the real one exists only on Ascend)."""
    stand_in = types.ModuleType("torch_npu")
    stand_in.contrib = types.ModuleType("torch_npu.contrib")
    stand_in.contrib.transfer_to_npu = types.ModuleType("torch_npu.contrib.transfer_to_npu")
    for name, mod in (("torch_npu", stand_in), ("torch_npu.contrib", stand_in.contrib),
                      ("torch_npu.contrib.transfer_to_npu", stand_in.contrib.transfer_to_npu)):
        monkeypatch.setitem(sys.modules, name, mod)
    return stand_in


@pytest.fixture
def adaptor(monkeypatch, torch_npu_stand_in):
    """mindspeed.megatron_adaptor imported for its argument parsing only, with our patch applied."""
    from mindspeed.deprecate import NoExecuteFunction

    monkeypatch.delitem(sys.modules, "mindspeed.megatron_adaptor", raising=False)
    monkeypatch.setattr(sys, "argv", ["ray_worker"])  # a verl Ray worker has no MindSpeed command line
    ap.apply_all(PATCHES)
    try:
        with NoExecuteFunction():
            mod = importlib.import_module("mindspeed.megatron_adaptor")
        yield mod
    finally:
        ap.undo([p.id for p in PATCHES])
        ma.set_pending_mindspeed_args({})
        sys.modules.pop("mindspeed.megatron_adaptor", None)


def parsed(adaptor, recipe: ma.RecipeMegatron):
    import mindspeed.args_utils as args_utils

    ma.set_pending_mindspeed_args(ma.mindspeed_args(recipe))
    args_utils._MINDSPEED_ARGS = None  # parsed once per process; each case is a fresh process's first parse
    return adaptor.get_mindspeed_args()


def test_the_installed_mindspeed_is_the_release_and_the_record_matches_it():
    lock = load_lock()
    comp = check_component(lock["mindspeed"], "npu", None)
    assert comp.status == "ok", comp.detail
    (p,) = PATCHES
    finding = check_patch(p, lock, "npu", None)
    assert finding.status == "ok", finding.detail


def test_the_recipe_flags_reach_mindspeeds_parsed_arguments(adaptor, monkeypatch):
    args = parsed(adaptor, recipe_megatron())
    want = ma.mindspeed_args(recipe_megatron())
    assert {k: getattr(args, k, "<absent>") for k in want} == want
    assert args.num_layer_list == "7,7,8,8,8,8,8,7" and args.swap_optimizer is True
    # A flag on the (worker's) command line still wins over the recipe's default.
    monkeypatch.setattr(sys, "argv", ["ray_worker", "--num-layer-list", "8,8,8,8,8,8,8,5"])
    assert parsed(adaptor, recipe_megatron()).num_layer_list == "8,8,8,8,8,8,8,5"


def test_mindspeeds_feature_manager_selects_the_recipes_features(adaptor):
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

    def selected(recipe):
        args = parsed(adaptor, recipe)
        return {f.feature_name for f in MindSpeedFeaturesManager.FEATURES_LIST if f.is_need_apply(args)}, args

    on, args = selected(recipe_megatron())
    # Swap optimizer and flash attention are chosen by the recipe's flags; at this release the fused
    # RoPE and SwiGLU kernels are optimisation level 0 (applied whatever the flag says).
    assert {"swap_optimizer", "use_flash_attn", "use_fused_rotary_pos_emb", "use_swiglu"} <= on
    assert "moe_tp_extend_ep" not in on
    off, _ = selected(recipe_megatron(swap_optimizer=False, use_flash_attn=False, use_fused_rotary_pos_emb=False))
    assert "swap_optimizer" not in off and "use_flash_attn" not in off
    assert {"use_fused_rotary_pos_emb", "use_swiglu"} <= off
    # The checks MindSpeed runs on these features accept the recipe's values.
    for f in MindSpeedFeaturesManager.FEATURES_LIST:
        if f.feature_name in ("swap_optimizer", "pipeline_num_transformer_layers"):
            f.validate_args(args)


def test_moe_tp_extend_ep_brings_what_mindspeed_requires_with_it(adaptor):
    from mindspeed.features_manager.moe.tp_extend_ep import MoETpExtendEpFeature

    args = parsed(adaptor, recipe_megatron(moe_tp_extend_ep=True))
    args.num_experts, args.tensor_model_parallel_size, args.expert_model_parallel_size = 256, 4, 8
    args.moe_expert_capacity_factor = None
    MoETpExtendEpFeature().validate_args(args)  # raises without moe_permutation_async_comm / moe_grouped_gemm
    args.moe_permutation_async_comm = False
    with pytest.raises(AssertionError, match="moe-permutation-async-comm"):
        MoETpExtendEpFeature().validate_args(args)


def test_every_flag_the_recipe_hands_over_is_a_name_mindspeed_reads(torch_npu_stand_in):
    import argparse

    from mindspeed.arguments import process_args
    from mindspeed.features_manager import create_features_list

    dests = {a.dest for a in process_args(argparse.ArgumentParser(allow_abbrev=False))._actions}
    features = {f.feature_name for f in create_features_list()}
    every = ma.mindspeed_args(ma.parse({k: True for k in ma.MINDSPEED_ARG if k != "num_layer_list"}
                                       | {"num_layer_list": [1]}))
    assert not set(every) - (dests | features), set(every) - (dests | features)


def test_mindspeed_replaces_torch_compile_and_the_rollout_gets_the_real_one_back(monkeypatch, torch_npu_stand_in):
    import torch
    from mindspeed.core.megatron_basic.requirements_basic import dummy_compile
    from mindspeed.features_manager.megatron_basic.requirements_basic import RequirementsBasicFeature

    class Recorder:  # records what MindSpeed's patch manager would be told, applies nothing
        seen: dict = {}

        @classmethod
        def register_patch(cls, name, new=None, create_dummy=False):
            cls.seen[name] = new

    RequirementsBasicFeature().te_adaptation(Recorder, None)
    mindspeeds = Recorder.seen["torch.compile"]
    # At v2.2.0_core_r0.12.1 a call-through for both (v2.1.0 put torch.jit.script in torch.compile's place).
    assert mindspeeds is dummy_compile and Recorder.seen["torch.jit.script"] is dummy_compile
    assert not cc.is_torch_own(mindspeeds)
    real = torch.compile
    monkeypatch.setattr(cc, "_SAVED", {})
    assert cc.save_real_compile()
    monkeypatch.setattr(torch, "compile", mindspeeds)
    with cc.real_torch_compile():
        assert torch.compile is real
    assert torch.compile is mindspeeds
