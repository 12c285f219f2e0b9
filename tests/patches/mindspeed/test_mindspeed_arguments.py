"""MindSpeed takes recipe.megatron's flags as its argument defaults (patch mindspeed.recipe_megatron_args, Ascend only).

MindSpeed is not importable here (it is not on the package registry and needs torch_npu), so the
patch cannot be applied and its target cannot be fingerprinted from an installed tree. What this
checks instead: the record (NPU-only, the MindSpeed commit its fingerprint was computed from, the
doctor's verdict off and on Ascend, a loud failure when applied without MindSpeed), and the wrapper
on a real argparse parser with a stand-in process_args that adds MindSpeed's flags the way
mindspeed/arguments.py does (store_true). The hand-over through the worker binding, with a stand-in
MindSpeed package imported after the values are recorded, is in
tests/patches/verl/test_recipe_megatron_binding.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import re

import pytest

from verl_patches import megatron_args as ma
from verl_patches.core.apply import PatchError, apply_all
from verl_patches.core.doctor import check_patch, run_doctor
from verl_patches.core.lock import load_lock
from verl_patches.patches.mindspeed.patch_arguments import PATCHES, SOURCE_COMMIT, wrap_process_args

FLAGS = ("--moe-tp-extend-ep", "--moe-permutation-async-comm", "--swap-optimizer", "--use-flash-attn",
         "--use-fused-rotary-pos-emb", "--use-fused-swiglu")


def process_args(parser):  # stand-in with the shape of mindspeed/arguments.py:process_args
    for flag in FLAGS:
        parser.add_argument(flag, action="store_true")
    return parser


@pytest.fixture
def pending():
    def set_(values):
        ma.set_pending_mindspeed_args(values)

    yield set_
    ma.set_pending_mindspeed_args({})


def test_mindspeed_is_not_importable_here():
    assert importlib.util.find_spec("mindspeed") is None


def test_the_record_is_ascend_only_and_names_its_source():
    (p,) = PATCHES
    assert p.target == "mindspeed.arguments:process_args" and p.upstream == "mindspeed"
    assert p.platforms == ("npu",) and p.applies_on("npu") and not p.applies_on("cpu") and not p.applies_on("cuda")
    assert re.fullmatch(r"[0-9a-f]{40}", SOURCE_COMMIT) and p.extra["source_commit"] == SOURCE_COMMIT
    assert p.fingerprint.signature == "def process_args(parser)"


def test_the_doctor_requires_it_only_on_ascend_and_leaves_an_absent_mindspeed_to_the_lock():
    (p,) = PATCHES
    lock = load_lock()
    off = check_patch(p, lock, "cpu", None)
    on = check_patch(p, lock, "npu", None)
    assert off.status == on.status == "missing" and on.upstream_absent
    assert not off.required and on.required
    # Without MindSpeed there is nothing to compare the fingerprint with: the lock's mindspeed line
    # carries the failure, so --strict on Ascend fails and the patches-only check does not.
    findings, strict_code = run_doctor([p], "npu", strict=True)
    failed = [f.id for f in findings if f.failed]
    assert strict_code == 1 and "lock:mindspeed" in failed and p.id not in failed
    assert run_doctor([p], "npu", strict=False)[1] == 0


def test_applying_without_mindspeed_fails_loudly():
    with pytest.raises(PatchError, match="cannot be imported"):
        apply_all(PATCHES)


def test_the_recipe_values_become_mindspeeds_defaults(pending):
    pending(ma.mindspeed_args(ma.parse({"num_layer_list": [7, 7, 8, 8, 8, 8, 8, 7], "moe_tp_extend_ep": True,
                                        "swap_optimizer": False, "use_flash_attn": True,
                                        "use_fused_rotary_pos_emb": True, "use_fused_swiglu": True})))
    parser = wrap_process_args(process_args)(argparse.ArgumentParser())
    args, _ = parser.parse_known_args([])
    assert args.moe_tp_extend_ep and args.moe_permutation_async_comm and args.use_flash_attn
    assert args.use_fused_rotary_pos_emb and args.use_fused_swiglu and not args.swap_optimizer
    assert args.num_layer_list == "7,7,8,8,8,8,8,7" and args.moe_grouped_gemm is True
    # A flag on the command line still wins over the recipe's default.
    assert parser.parse_known_args(["--swap-optimizer"])[0].swap_optimizer is True


def test_without_recorded_values_mindspeeds_parser_is_unchanged(pending):
    pending({})
    args, _ = wrap_process_args(process_args)(argparse.ArgumentParser()).parse_known_args([])
    assert not any(vars(args).values()) and not hasattr(args, "num_layer_list")
