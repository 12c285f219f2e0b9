"""Uneven pipeline stages from recipe.megatron.num_layer_list on 4 gloo processes (PP4, layers 1,2,2,1):
real megatron-core 0.12.1 parallel state and GPTModel (MLA + MoE, first layer dense) built from the
TransformerConfig that verl 0.4.1's real worker method and converter make (patches
megatron.num_layer_list.layers_to_build, megatron.num_layer_list.layer_offset,
verl.num_layer_list.layer_offset, verl.recipe_megatron.binding, verl.mcore_config.deepseek_v3).
Stand-ins: see recipe_megatron_rank.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verl_patches.launch.local_ranks import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_megatron_rank import uneven_rank  # noqa: E402

# Multi-process or Ray: the slow tier (README: fast tier = -m 'not slow').
pytestmark = pytest.mark.slow

LIST = [1, 2, 2, 1]
OFFSETS = [0, 1, 3, 5]


@pytest.fixture(scope="module")
def ranks():
    out = run_distributed(uneven_rank, len(LIST), {"layers": sum(LIST), "dense": 1, "num_layer_list": LIST},
                          timeout=280)
    for r in out:
        assert "error" not in r, r
    return sorted(out, key=lambda r: r["pp_rank"])


def test_each_stage_builds_its_entry_with_global_layer_numbers(ranks):
    assert [r["layer_numbers"] for r in ranks] == [[1], [2, 3], [4, 5], [6]]
    assert [r["pre_post"] for r in ranks] == [[True, False], [False, False], [False, False], [False, True]]


def test_dense_and_moe_layers_follow_the_global_numbers(ranks):
    # first_k_dense_replace=1: only global layer 0 is dense, wherever the stage boundaries fall.
    assert [r["moe"] for r in ranks] == [[False], [True, True], [True, True], [True]]


def test_checkpoint_and_rollout_names_carry_the_global_layer(ranks):
    assert [r["ckpt_layers"] for r in ranks] == [[0], [1, 2], [3, 4], [5]]
    names = [[int(n.split(".")[2]) for n in r["rollout_names"]] for r in ranks]
    assert names == [[0, 0], [1, 2], [3, 4], [5, 5]]


def test_upstream_cannot_build_it_and_verl_would_misname_the_layers(ranks):
    for r in ranks:
        assert r["upstream_layers_to_build"].startswith("AssertionError: num_layers should be divisible")
        assert r["upstream_verl_offsets"] == [0, 1, 2, 3] != OFFSETS
