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


def test_the_binding_names_mindspeed_llms_fused_down_projection_apart_as_views():
    """The live binding hands the plan MindSpeed-LLM's fused linear_qkv as the TE spec's two replicated down
    projections: row views of the one tensor (q_lora_rank rows, from linear_q_up_proj's input size, then kv's);
    its q / kv norms under their TE names, as for the local spec."""
    import torch

    from verl_patches.reshard.binding import megatron_params
    from verl_patches.reshard.model import LayoutError

    layer = torch.nn.Module()
    attn = torch.nn.Module()
    attn.linear_qkv = torch.nn.Linear(64, 48 + 40, bias=False)
    attn.linear_q_up_proj = torch.nn.Linear(48, 128, bias=False)
    attn.q_layernorm = torch.nn.LayerNorm(48, bias=False)
    layer.self_attention = attn
    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList([layer])
    model = torch.nn.Module()
    model.decoder = decoder
    got = megatron_params([model])
    fused = attn.linear_qkv.weight.data
    q, kv = got["decoder.layers.0.self_attention.linear_q_down_proj.weight"], \
        got["decoder.layers.0.self_attention.linear_kv_down_proj.weight"]
    assert q.shape == (48, 64) and kv.shape == (40, 64)
    assert q.data_ptr() == fused.data_ptr() and kv.data_ptr() == fused[48:].data_ptr()
    assert "decoder.layers.0.self_attention.linear_qkv.weight" not in got
    assert "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight" in got

    del attn.linear_q_up_proj  # no query LoRA: where q's rows end is unknown
    with pytest.raises(LayoutError, match=r"linear_qkv.weight: a fused down projection .*\(q_lora_rank\) only"):
        megatron_params([model])
