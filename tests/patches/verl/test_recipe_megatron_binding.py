"""DeepSeek-V3's TransformerConfig and recipe.megatron through verl 0.4.1's real converter and worker method
(patches verl.mcore_config.deepseek_v3 and verl.recipe_megatron.binding), on real megatron-core
0.12.1 parallel state (gloo, one process) and its real MLATransformerConfig.

The MindSpeed hand-over (Ascend only) runs against a declared stand-in MindSpeed package written here:
MindSpeed's features need torch_npu off the CPU test environment's reach; the stand-in has the shape of
the release's MindSpeedFeaturesManager.register_features_args (mindspeed/features_manager/features_manager.py)
and get_mindspeed_args (mindspeed/args_utils.py, imported by mindspeed/megatron_adaptor.py: argparse over
MindSpeed's flags, parsed once when the adaptor is imported), which is what decides MindSpeed's feature
patches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_patches.config import megatron_args as ma
from verl_patches.patches.verl.patch_single_controller_base_megatron_worker import check_weight_loading
from verl_patches.launch.local_ranks import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from recipe_megatron_rank import convert_rank  # noqa: E402

# Multi-process or Ray: the slow tier (README: fast tier = -m 'not slow').
pytestmark = pytest.mark.slow

REAL_V3 = Path(__file__).resolve().parents[3] / "configs" / "model" / "deepseek_v3.json"
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
ROPE_TYPE_ONLY = {k: v for k, v in YARN.items() if k != "type"} | {"rope_type": "yarn"}
RIGHT_ALREADY = ["multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                 "v_head_dim", "rope_type", "rotary_scaling_factor", "max_position_embeddings",
                 "moe_router_score_function", "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
                 "moe_layer_freq", "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_router_topk",
                 "moe_router_topk_scaling_factor", "num_moe_experts"]
GROUPS = ["moe_router_num_groups", "moe_router_group_topk"]
FULL = {"num_layer_list": [4], "moe_tp_extend_ep": True, "swap_optimizer": True, "use_flash_attn": True,
        "use_fused_rotary_pos_emb": True, "use_fused_swiglu": True}

STAND_IN = {
    "mindspeed/__init__.py": "",
    "mindspeed/features_manager/__init__.py": "",
    "mindspeed/features_manager/features_manager.py": (
        "class MindSpeedFeaturesManager:\n"
        "    @classmethod\n"
        "    def register_features_args(cls, parser):\n"
        "        for flag in ('--moe-tp-extend-ep', '--moe-permutation-async-comm', '--swap-optimizer',\n"
        "                     '--use-flash-attn', '--use-fused-rotary-pos-emb', '--use-fused-swiglu'):\n"
        "            parser.add_argument(flag, action='store_true')\n"),
    "mindspeed/args_utils.py": (
        "import argparse\n"
        "from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager\n"
        "_MINDSPEED_ARGS = None\n"
        "def get_mindspeed_args():\n"
        "    global _MINDSPEED_ARGS\n"
        "    if _MINDSPEED_ARGS is None:\n"
        "        parser = argparse.ArgumentParser(allow_abbrev=False)\n"
        "        MindSpeedFeaturesManager.register_features_args(parser)\n"
        "        _MINDSPEED_ARGS, _ = parser.parse_known_args([])\n"
        "    return _MINDSPEED_ARGS\n"),
    "mindspeed/megatron_adaptor.py": (
        "from mindspeed.args_utils import get_mindspeed_args\n"
        "PARSED_AT_IMPORT = dict(vars(get_mindspeed_args()))  # what the features register their patches by\n"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("mindspeed_stand_in")
    for rel, text in STAND_IN.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    yarn = {"rope_scaling": YARN}
    cases = {
        "upstream": dict(patched=False, model=yarn, fields=RIGHT_ALREADY + GROUPS),
        "patched": dict(model=yarn, fields=RIGHT_ALREADY + GROUPS),
        "user_wins": dict(model=yarn, overrides={"moe_router_group_topk": 1}, fields=GROUPS),
        "rope_type_upstream": dict(patched=False, model={"rope_scaling": ROPE_TYPE_ONLY}, fields=["rope_type"]),
        "rope_type_patched": dict(model={"rope_scaling": ROPE_TYPE_ONLY}, fields=["rope_type", "rotary_scaling_factor"]),
        "recipe": dict(recipe={"num_layer_list": [4], "use_fused_swiglu": True}, fields=["bias_activation_fusion"]),
        "recipe_upstream": dict(patched=False, recipe={"num_layer_list": [4]}),
        "bad_sum": dict(recipe={"num_layer_list": [3]}),
        "extend_ep_off_npu": dict(recipe={"moe_tp_extend_ep": True}),
        "unknown_key": dict(recipe={"num_layers_list": [4]}),
        "npu": dict(recipe=FULL, mindspeed_stand_in=str(root), fields=["bias_activation_fusion"]),
        # The real DeepSeek-V3 config with the recipe's layer list (config only: PP1 here, so one stage of 61).
        "deepseek_v3": dict(model_file=str(REAL_V3), recipe={"num_layer_list": [61], "use_fused_swiglu": True},
                            fields=RIGHT_ALREADY + GROUPS + ["num_layers", "hidden_size", "ffn_hidden_size",
                                                             "moe_ffn_hidden_size", "rotary_base"]),
        # The reference model passes through the binding again in the same process.
        "npu_again": dict(recipe=FULL, mindspeed_stand_in=str(root)),
    }
    (out,) = run_distributed(convert_rank, 1, list(cases.values()), timeout=200)
    return dict(zip(cases, out))


def test_verl_gets_mla_and_moe_right_but_drops_group_limited_routing(results):
    up = results["upstream"]
    assert up["ok"], up
    f = up["fields"]
    assert f["multi_latent_attention"] and (f["q_lora_rank"], f["kv_lora_rank"]) == (48, 32)
    assert (f["qk_head_dim"], f["qk_pos_emb_head_dim"], f["v_head_dim"]) == (16, 8, 16)
    assert (f["rope_type"], f["rotary_scaling_factor"], f["max_position_embeddings"]) == ("yarn", 40, 4096)
    assert f["moe_router_score_function"] == "sigmoid" and f["moe_router_enable_expert_bias"]
    assert f["moe_shared_expert_intermediate_size"] == 32 and f["moe_layer_freq"] == [0, 1, 1, 1]
    assert f["moe_grouped_gemm"] and f["moe_token_dispatcher_type"] == "alltoall"
    assert (f["moe_router_topk"], f["moe_router_topk_scaling_factor"], f["num_moe_experts"]) == (4, 2.5, 16)
    # The model routes inside topk_group=2 of n_group=4 groups; upstream lets a token reach any expert.
    assert (f["moe_router_num_groups"], f["moe_router_group_topk"]) == (None, None)


def test_the_patch_adds_the_groups_and_keeps_the_rest(results):
    p = results["patched"]
    assert p["ok"], p
    assert (p["fields"]["moe_router_num_groups"], p["fields"]["moe_router_group_topk"]) == (4, 2)
    same = {k: v for k, v in p["fields"].items() if k not in GROUPS}
    assert same == {k: v for k, v in results["upstream"]["fields"].items() if k not in GROUPS}
    assert results["user_wins"]["fields"]["moe_router_group_topk"] == 1  # override_transformer_config wins


def test_the_real_deepseek_v3_config(results):
    r = results["deepseek_v3"]
    assert r["ok"], r
    f = r["fields"]
    assert (f["num_layers"], f["hidden_size"], f["ffn_hidden_size"], f["moe_ffn_hidden_size"]) == (61, 7168, 18432, 2048)
    assert (f["q_lora_rank"], f["kv_lora_rank"], f["qk_head_dim"], f["qk_pos_emb_head_dim"], f["v_head_dim"]) == \
        (1536, 512, 128, 64, 128)
    assert (f["rope_type"], f["rotary_scaling_factor"], f["max_position_embeddings"], f["rotary_base"]) == \
        ("yarn", 40, 4096, 10000)
    assert f["moe_layer_freq"] == [0] * 3 + [1] * 58 and f["moe_shared_expert_intermediate_size"] == 2048
    assert (f["num_moe_experts"], f["moe_router_topk"], f["moe_router_topk_scaling_factor"]) == (256, 8, 2.5)
    assert (f["moe_router_num_groups"], f["moe_router_group_topk"]) == (8, 4)
    assert r["num_layer_list"] == [61]


def test_a_rope_type_only_config_gets_yarn(results):
    assert results["rope_type_upstream"]["fields"]["rope_type"] == "rope"  # upstream silently drops YaRN
    assert results["rope_type_patched"]["fields"] == {"rope_type": "yarn", "rotary_scaling_factor": 40}


def test_the_worker_binding_attaches_the_layer_list_and_the_fused_swiglu(results):
    r = results["recipe"]
    assert r["ok"], r
    assert r["num_layer_list"] == [4] and r["fields"]["bias_activation_fusion"] is True
    assert results["recipe_upstream"]["num_layer_list"] == "absent"  # verl 0.4.1 reads recipe.megatron nowhere


@pytest.mark.parametrize("case,needles", [
    ("bad_sum", ["RecipeMegatronError", ma.SECTION, "num_layer_list [3] sums to 3, the model has 4 layers"]),
    ("extend_ep_off_npu", [ma.SECTION + ".moe_tp_extend_ep needs MindSpeed", "expert_model_parallel_size = TP x EP"]),
    ("unknown_key", [ma.SECTION, "unknown key(s) ['num_layers_list']"]),
])
def test_bad_sections_are_refused_naming_the_key(results, case, needles):
    r = results[case]
    assert not r["ok"]
    for n in needles:
        assert n in r["error"], r["error"]


def test_on_ascend_mindspeed_parses_the_recipe_flags_when_its_adaptor_is_imported(results):
    r = results["npu"]
    assert r["ok"], r
    want = ma.mindspeed_args(ma.parse(FULL))
    at_import = r["mindspeed_parsed_at_import"]
    # Its own flags come out of its parser as the recipe set them (what its features register patches by) ...
    for k in ("moe_tp_extend_ep", "moe_permutation_async_comm", "swap_optimizer", "use_flash_attn",
              "use_fused_rotary_pos_emb", "use_fused_swiglu"):
        assert at_import[k] is True, k
    # ... and the arguments it does not define itself ride along as defaults.
    assert at_import["num_layer_list"] == "4" and at_import["moe_grouped_gemm"] is True
    assert {k: r["mindspeed_args"][k] for k in want} == want
    assert r["num_layer_list"] == [4] and r["fields"]["bias_activation_fusion"] is True
    assert r["warnings"] == []
    again = results["npu_again"]
    assert again["ok"] and again["warnings"] == [] and again["mindspeed_args"]["moe_tp_extend_ep"] is True


def _worker_cfg(load: bool, dist_ckpt: bool, save=("model", "optimizer", "extra")):
    return OmegaConf.create({"actor": {"load_weight": load, "megatron": {"use_dist_checkpointing": dist_ckpt},
                                       "checkpoint": {"save_contents": list(save)}},
                             "ref": {"load_weight": load, "megatron": {"use_dist_checkpointing": dist_ckpt}}})


def test_uneven_stages_need_the_distributed_checkpoint_to_load_and_save_weights():
    uneven, even = ma.parse({"num_layer_list": [7, 8]}), ma.parse({"num_layer_list": [8, 8]})
    with pytest.raises(ma.RecipeMegatronError, match="actor.megatron.use_dist_checkpointing"):
        check_weight_loading(_worker_cfg(load=True, dist_ckpt=False), uneven)
    check_weight_loading(_worker_cfg(load=True, dist_ckpt=True), uneven)
    check_weight_loading(_worker_cfg(load=False, dist_ckpt=False), uneven)  # random init
    check_weight_loading(_worker_cfg(load=True, dist_ckpt=False), even)
    with pytest.raises(ma.RecipeMegatronError, match="actor.checkpoint.save_contents has 'hf_model'"):
        check_weight_loading(_worker_cfg(load=False, dist_ckpt=True, save=("model", "hf_model")), uneven)


def test_a_mindspeed_imported_before_the_binding_still_gets_the_values_and_a_warning(monkeypatch, caplog):
    import argparse
    import types

    from verl_patches.patches.verl import patch_single_controller_base_megatron_worker as binding

    parsed, global_args = argparse.Namespace(use_fused_swiglu=False), argparse.Namespace()
    adaptor = types.ModuleType("mindspeed.megatron_adaptor")  # stand-in: imported earlier by someone else
    adaptor.get_mindspeed_args = lambda: parsed
    gv = types.ModuleType("megatron.training.global_vars")  # stand-in: megatron-LM's global args
    gv._GLOBAL_ARGS = global_args
    monkeypatch.setitem(sys.modules, "mindspeed.megatron_adaptor", adaptor)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    monkeypatch.setattr(binding, "_IMPORTED_BY_US", None)
    values = ma.mindspeed_args(ma.parse(FULL))
    try:
        with caplog.at_level("WARNING", logger=binding.__name__):
            binding.hand_to_mindspeed(values)
    finally:
        ma.set_pending_mindspeed_args({})
    assert "feature patches chosen at import keep their choice" in caplog.text
    assert {k: getattr(parsed, k) for k in values} == values == {k: getattr(global_args, k) for k in values}
