"""MindSpeed takes recipe.megatron's flags as its argument defaults (patch mindspeed.recipe_megatron_args, Ascend only).

These run with or without MindSpeed installed: the record against the lock's release, the doctor's
verdict where MindSpeed is absent (an empty upstream root stands for a machine without it), a loud
failure when the patch is applied without MindSpeed (the import is blocked), and the wrapper's logic
on a plain argparse parser with a stand-in register_features_args that adds flags the way MindSpeed's
features do (store_true). The same hand-over against the real MindSpeed release is
in test_mindspeed_release.py; the binding that records the values, in
tests/patches/verl/test_recipe_megatron_binding.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import re

import pytest

from verl_patches.config import megatron_args as ma
from verl_patches.core.apply import PatchError, apply_all
from verl_patches.core.doctor import check_patch, is_failing, run_doctor
from verl_patches.core.lock import load_lock
from verl_patches.patches.mindspeed.patch_arguments import (PATCHES, RELEASE_COMMIT, RELEASE_TAG,
                                                             wrap_register_features_args)

FLAGS = ("--moe-tp-extend-ep", "--moe-permutation-async-comm", "--swap-optimizer", "--use-flash-attn",
         "--use-fused-rotary-pos-emb", "--use-fused-swiglu")


def register_features_args(cls, parser):  # stand-in: MindSpeedFeaturesManager.register_features_args's function
    for flag in FLAGS:
        parser.add_argument(flag, action="store_true")


def parser_of(wrapped):
    parser = argparse.ArgumentParser()
    assert wrapped(object, parser) is None  # like upstream's, it returns nothing
    return parser


@pytest.fixture
def pending():
    def set_(values):
        ma.set_pending_mindspeed_args(values)

    yield set_
    ma.set_pending_mindspeed_args({})


def test_the_record_is_ascend_only_and_pins_the_locks_release():
    (p,) = PATCHES
    comp = load_lock()["mindspeed"]
    assert p.target == ("mindspeed.features_manager.features_manager:MindSpeedFeaturesManager."
                        "register_features_args") and p.upstream == "mindspeed"
    assert p.platforms == ("npu",) and p.applies_on("npu") and not p.applies_on("cpu") and not p.applies_on("cuda")
    assert (RELEASE_TAG, RELEASE_COMMIT) == (comp.ref, comp.commit) and p.extra["source_commit"] == comp.commit
    assert re.fullmatch(r"[0-9a-f]{40}", RELEASE_COMMIT) and RELEASE_TAG in p.upstream_ref
    # A real range: the release's own version, not ">=0".
    assert p.versions == f"=={comp.version}"
    assert p.fingerprint.signature == "def register_features_args(cls, parser)"


def test_the_doctor_requires_it_only_on_ascend_and_leaves_an_absent_mindspeed_to_the_lock(tmp_path):
    (p,) = PATCHES
    lock = load_lock()
    off = check_patch(p, lock, "cpu", tmp_path)
    on = check_patch(p, lock, "npu", tmp_path)
    assert off.status == on.status == "missing" and on.upstream_absent
    assert not off.required and on.required
    # Without MindSpeed there is nothing to compare the fingerprint with: the lock's mindspeed line
    # carries the failure (an absent required component fails with or without --strict), the
    # patch's own line does not.
    for strict in (True, False):
        findings, code = run_doctor([p], "npu", root=tmp_path, strict=strict)
        failing = {f.id for f in findings if is_failing(f, strict)}
        assert code == 1 and "lock:mindspeed" in failing and p.id not in failing


@pytest.mark.skipif(importlib.util.find_spec("mindspeed") is not None,
                    reason="MindSpeed is installed here: test_mindspeed_release.py applies the patch to it")
def test_applying_without_mindspeed_fails_loudly():
    with pytest.raises(PatchError, match="cannot be imported"):
        apply_all(PATCHES)


def test_the_recipe_values_become_mindspeeds_defaults(pending):
    pending(ma.mindspeed_args(ma.parse({"num_layer_list": [7, 7, 8, 8, 8, 8, 8, 7], "moe_tp_extend_ep": True,
                                        "swap_optimizer": False, "use_flash_attn": True,
                                        "use_fused_rotary_pos_emb": True, "use_fused_swiglu": True})))
    parser = parser_of(wrap_register_features_args(register_features_args))
    args, _ = parser.parse_known_args([])
    assert args.moe_tp_extend_ep and args.moe_permutation_async_comm and args.use_flash_attn
    assert args.use_fused_rotary_pos_emb and args.use_fused_swiglu and not args.swap_optimizer
    assert args.num_layer_list == "7,7,8,8,8,8,8,7" and args.moe_grouped_gemm is True
    # A flag on the command line still wins over the recipe's default.
    assert parser.parse_known_args(["--swap-optimizer"])[0].swap_optimizer is True


def test_without_recorded_values_mindspeeds_parser_is_unchanged(pending):
    pending({})
    args, _ = parser_of(wrap_register_features_args(register_features_args)).parse_known_args([])
    assert not any(vars(args).values()) and not hasattr(args, "num_layer_list")
