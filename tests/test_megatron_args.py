"""recipe.megatron parsing, layout checks, per-stage spans and the MindSpeed / TransformerConfig mapping
(verl_patches/config/megatron_args.py; framework-free)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_patches.config import megatron_args as ma

REPO = Path(__file__).resolve().parents[1]
RECIPE = {"num_layer_list": [7, 7, 8, 8, 8, 8, 8, 7], "moe_tp_extend_ep": True, "swap_optimizer": True,
          "use_flash_attn": True, "use_fused_rotary_pos_emb": True, "use_fused_swiglu": True}


def test_the_recipe_section_parses():
    r = ma.parse(RECIPE)
    assert r.num_layer_list == (7, 7, 8, 8, 8, 8, 8, 7) and r.moe_tp_extend_ep and r.use_fused_swiglu
    assert ma.parse(None) == ma.RecipeMegatron()
    assert ma.parse({"num_layer_list": "7, 7,8"}).num_layer_list == (7, 7, 8)  # MindSpeed's own string form


@pytest.mark.parametrize("section,needle", [
    ({"num_layer_list": [7, 0, 8]}, "num_layer_list entries must be integers >= 1, got 0"),
    ({"num_layer_list": [7, 7.5]}, "got 7.5"),
    ({"num_layer_list": [True, 2]}, "got True"),
    ({"num_layer_list": []}, "non-empty list"),
    ({"swap_optimizer": "yes"}, "swap_optimizer must be true or false"),
    ({"use_flash_atn": True}, "unknown key(s) ['use_flash_atn']"),
])
def test_malformed_sections_name_the_key(section, needle):
    with pytest.raises(ma.RecipeMegatronError) as e:
        ma.parse(section)
    assert str(e.value).startswith(ma.SECTION) and needle in str(e.value)


def test_the_256_die_layout_passes_and_wrong_ones_name_their_key():
    r = ma.parse(RECIPE)
    ma.check_layout(r, num_layers=61, pp=8, tp=4, ep=8, etp=1, num_experts=256)
    cases = [
        (dict(num_layers=62, pp=8), "sums to 61, the model has 62 layers"),
        (dict(num_layers=61, pp=4), "num_layer_list has 8 stages, pipeline_model_parallel_size is 4"),
        (dict(num_layers=61, pp=8, vpp=2), "virtual pipeline"),
        (dict(num_layers=61, pp=8, tp=4, ep=8, etp=4), "expert_tensor_parallel_size must be 1, got 4"),
        (dict(num_layers=61, pp=8, tp=4, ep=8, etp=1, num_experts=48), "48 routed experts do not divide over TP4 x EP8"),
    ]
    for kw, needle in cases:
        with pytest.raises(ma.RecipeMegatronError, match=ma.SECTION) as e:
            ma.check_layout(r, **kw)
        assert needle in str(e.value), (kw, str(e.value))
    # Without moe_tp_extend_ep, expert TP is megatron's own business.
    ma.check_layout(ma.RecipeMegatron(), num_layers=61, pp=8, etp=4)


def test_stage_spans_cover_the_model_once():
    lst = (7, 7, 8, 8, 8, 8, 8, 7)
    spans = [ma.stage_span(lst, p) for p in range(8)]
    assert spans[0] == (0, 7) and spans[1] == (7, 7) and spans[2] == (14, 8) and spans[7] == (54, 7)
    covered = [i for off, n in spans for i in range(off, off + n)]
    assert covered == list(range(61))
    with pytest.raises(ma.RecipeMegatronError, match="no stage 8"):
        ma.stage_span(lst, 8)
    assert ma.is_uneven(ma.parse(RECIPE)) and not ma.is_uneven(ma.parse({"num_layer_list": [4, 4]}))


def test_mindspeed_arguments_use_mindspeeds_names():
    args = ma.mindspeed_args(ma.parse(RECIPE))
    assert args == {"moe_tp_extend_ep": True, "swap_optimizer": True, "use_flash_attn": True,
                    "use_fused_rotary_pos_emb": True, "use_fused_swiglu": True,
                    # MoETpExtendEpFeature.validate_args requires both with --moe-tp-extend-ep.
                    "moe_permutation_async_comm": True, "moe_grouped_gemm": True,
                    # Flags the section leaves out are handed over as off.
                    "use_fused_rmsnorm": False, "moe_alltoall_overlap_comm": False,
                    "use_fused_moe_token_permute_and_unpermute": False, "gemm_gradient_accumulation_fusion": False,
                    "num_layer_list": "7,7,8,8,8,8,8,7"}
    off = ma.mindspeed_args(ma.RecipeMegatron())
    assert off["moe_tp_extend_ep"] is False and "num_layer_list" not in off and "moe_grouped_gemm" not in off


def test_transformer_config_overrides_and_the_users_entries_win():
    assert ma.transformer_config_overrides(ma.parse(RECIPE)) == {"bias_activation_fusion": True}
    assert ma.transformer_config_overrides(ma.RecipeMegatron()) == {}  # off: verl's own choice stays
    ours = {"bias_activation_fusion": True, "x": 1}
    assert ma.merge_overrides({"bias_activation_fusion": False}, ours) == {"bias_activation_fusion": False, "x": 1}
    assert ma.merge_overrides(None, ours) == ours


def test_deepseek_v3_overrides_from_the_real_config():
    cfg = json.loads((REPO / "configs" / "model" / "deepseek_v3.json").read_text())
    assert ma.deepseek_v3_overrides(cfg) == {"moe_router_num_groups": 8, "moe_router_group_topk": 4}
    # A config naming the RoPE type only as rope_type: verl would read plain RoPE.
    only_rope_type = dict(cfg, rope_scaling={k: v for k, v in cfg["rope_scaling"].items() if k != "type"}
                          | {"rope_type": "yarn"})
    assert ma.deepseek_v3_overrides(only_rope_type)["rope_type"] == "yarn"
    assert ma.deepseek_v3_overrides(dict(cfg, n_group=1)) == {}
    with pytest.raises(ma.RecipeMegatronError, match="norm_topk_prob"):
        ma.deepseek_v3_overrides(dict(cfg, norm_topk_prob=False))
    with pytest.raises(ma.RecipeMegatronError, match="without topk_group"):
        ma.deepseek_v3_overrides(dict(cfg, topk_group=None))


def test_pending_mindspeed_arguments_are_replaced_not_merged():
    ma.set_pending_mindspeed_args({"a": 1})
    ma.set_pending_mindspeed_args({"b": 2})
    try:
        assert ma.pending_mindspeed_args() == {"b": 2}
    finally:
        ma.set_pending_mindspeed_args({})


def test_the_alltoall_overlap_needs_moe_tp_extend_ep():
    with pytest.raises(ma.RecipeMegatronError, match="moe_alltoall_overlap_comm needs moe_tp_extend_ep"):
        ma.check_layout(ma.parse({"moe_alltoall_overlap_comm": True}), num_layers=4, pp=1)
    ma.check_layout(ma.parse({"moe_alltoall_overlap_comm": True, "moe_tp_extend_ep": True}), num_layers=4, pp=1)
    args = ma.mindspeed_args(ma.parse({"moe_alltoall_overlap_comm": True, "moe_tp_extend_ep": True}))
    assert args["moe_permutation_async_comm"] and args["moe_grouped_gemm"]


def test_megatron_argv_from_the_hf_config_layout_and_recipe_flags():
    hf = json.loads((Path(__file__).resolve().parents[1] / "configs/model/tiny_deepseek_v3.json").read_text())
    recipe = ma.parse({"num_layer_list": [3, 1], "use_flash_attn": True, "swap_optimizer": True})
    argv = ma.megatron_argv(hf, recipe, seq_length=96, tp=2, pp=2, ep=2, etp=1)
    opts = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")
            and not argv[i + 1].startswith("--")}
    assert opts["--num-layers"] == "4" and opts["--q-lora-rank"] == "48" and opts["--kv-lora-rank"] == "32"
    assert opts["--num-experts"] == "16" and opts["--moe-router-topk"] == "4" and opts["--seq-length"] == "96"
    assert (opts["--tensor-model-parallel-size"], opts["--pipeline-model-parallel-size"],
            opts["--expert-model-parallel-size"], opts["--expert-tensor-parallel-size"]) == ("2", "2", "2", "1")
    assert opts["--num-layer-list"] == "3,1"
    assert {"--use-flash-attn", "--swap-optimizer", "--bf16", "--multi-latent-attention"} <= set(argv)
    assert "--use-fused-swiglu" not in argv  # off in the recipe: no flag
    assert argv[-3:] == ["--spec", "mindspeed_llm.tasks.models.spec.deepseek_spec", "layer_spec"]
    with pytest.raises(ma.RecipeMegatronError, match=r"\['q_lora_rank'\] missing"):
        ma.megatron_argv({k: v for k, v in hf.items() if k != "q_lora_rank"}, seq_length=96)
    with pytest.raises(ma.RecipeMegatronError, match="dtype must be"):
        ma.megatron_argv(hf, seq_length=96, dtype="fp8")
