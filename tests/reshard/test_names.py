"""The Megatron names of the three layer specs: module parameter names and distributed-checkpoint keys."""

import pytest

from verl_patches.reshard import deepseek_v3_names as names


def test_te_and_local_save_each_parameter_under_its_own_name():
    for group in (names.ATTN, names.DENSE, names.MOE, names.EDGES):
        for n in group.values():
            for spec in ("te", "local"):
                assert n.key_for(spec) == n.mcore_for(spec)


def test_mindspeed_llm_parameter_names_and_checkpoint_keys():
    A, D, M = names.ATTN, names.DENSE, names.MOE
    # One fused down projection for q (with or without a query LoRA rank) and kv.
    for k in ("q_a_proj", "q_proj", "kv_a_proj"):
        assert A[k].mcore_for("mindspeed_llm") == A[k].key_for("mindspeed_llm") == "self_attention.linear_qkv.weight"
    # The input norm and the pre-MLP norm (dense and MoE layers) are modules saved under TE's fused keys.
    assert A["input_layernorm"].mcore_for("mindspeed_llm") == "input_layernorm.weight"
    assert A["input_layernorm"].key_for("mindspeed_llm") == "self_attention.linear_qkv.layer_norm_weight"
    for group in (D, M):
        n = group["post_attention_layernorm"]
        assert n.mcore_for("mindspeed_llm") == "pre_mlp_layernorm.weight"
        assert n.key_for("mindspeed_llm") == "mlp.linear_fc1.layer_norm_weight"
    # q / kv norms as the local spec names them; the rest as the TE spec.
    assert A["q_a_layernorm"].key_for("mindspeed_llm") == "self_attention.q_layernorm.weight"
    assert A["kv_a_layernorm"].key_for("mindspeed_llm") == "self_attention.kv_layernorm.weight"
    for k in ("q_b_proj", "kv_b_proj", "o_proj"):
        assert A[k].key_for("mindspeed_llm") == A[k].mcore
    for group in (M, names.EDGES):
        for k, n in group.items():
            if k != "post_attention_layernorm":
                assert n.key_for("mindspeed_llm") == n.mcore_for("mindspeed_llm") == n.mcore, k


def test_an_unknown_spec_is_named():
    with pytest.raises(ValueError, match=r"spec 'transformer_engine': expected one of 'te', 'local', 'mindspeed_llm'"):
        names.ATTN["o_proj"].mcore_for("transformer_engine")
    with pytest.raises(ValueError, match="expected one of"):
        names.ckpt_key("input_layernorm.weight", "mindspeed")
