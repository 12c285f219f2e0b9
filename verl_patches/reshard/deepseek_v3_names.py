"""DeepSeek-V3's parameter names, written once: the HF checkpoint's (which vLLM loads), Megatron's
(Transformer-Engine spec, which verl builds; the local spec, which keeps the layer norms as modules of
their own; MindSpeed-LLM's DeepSeek spec, which the NPU path builds: one fused, TP-replicated down
projection ``linear_qkv`` for q and kv, and checkpoint keys for its two layer norms that differ from
their module names), and vLLM's fused parameters. The reshard's placements, the checkpoint tools, the
live-model binding and the test models all read them from here; the real megatron-core and vLLM
modules the tests build are what checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HF_LAYER = "model.layers.{}."  # + the names below
MCORE_LAYER = "decoder.layers.{}."  # + the names below (local layer index on a pipeline stage)


SPECS = ("te", "local", "mindspeed_llm")
# MindSpeed-LLM's DeepSeek layer spec renames these module prefixes in the layer's distributed-checkpoint
# keys (its TransformerLayer's sharded_state_dict_keys_map): the norms are saved under the names the
# Transformer-Engine spec gives its fused norms. The other specs save every parameter under its own name.
CKPT_KEY_PREFIXES = {
    "te": {},
    "local": {},
    "mindspeed_llm": {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                      "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
}


def _check_spec(spec: str) -> None:
    if spec not in SPECS:
        raise ValueError(f"Megatron layer spec {spec!r}: expected one of {', '.join(map(repr, SPECS))}")


@dataclass(frozen=True)
class Name:
    hf: str  # under HF_LAYER
    mcore: str  # under MCORE_LAYER, Transformer-Engine spec
    local: str | None = None  # under MCORE_LAYER, megatron-core's local spec where it differs
    mindspeed_llm: str | None = None  # under MCORE_LAYER, MindSpeed-LLM's DeepSeek spec where it differs from TE

    def mcore_for(self, spec: str) -> str:
        """The module parameter name (the model's ``named_parameters`` / ``state_dict``) under ``spec``."""
        _check_spec(spec)
        own = {"local": self.local, "mindspeed_llm": self.mindspeed_llm}.get(spec)
        return own if own is not None else self.mcore

    def key_for(self, spec: str) -> str:
        """The distributed-checkpoint key (the model's ``sharded_state_dict``) under ``spec``: the parameter
        name, with the spec's layer-level prefix renames applied."""
        return ckpt_key(self.mcore_for(spec), spec)


def ckpt_key(param: str, spec: str) -> str:
    """A layer parameter's (name under MCORE_LAYER) distributed-checkpoint key under ``spec``."""
    _check_spec(spec)
    for old, new in CKPT_KEY_PREFIXES[spec].items():
        if param.startswith(old):
            return new + param[len(old):]
    return param


# MindSpeed-LLM's fused down projection (a replicated plain Linear): its output rows are q's (q_a_proj's rows
# with a query LoRA rank, q_proj's without) then kv_a_proj_with_mqa's (kv_lora_rank + qk_rope_head_dim).
MINDSPEED_LLM_QKV = "self_attention.linear_qkv.weight"

# Multi-head latent attention. q_a_* / q_b_proj with a query LoRA rank, q_proj without.
ATTN = {
    "input_layernorm": Name("input_layernorm.weight", "input_layernorm.weight"),
    "q_a_proj": Name("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight",
                     mindspeed_llm=MINDSPEED_LLM_QKV),
    "q_a_layernorm": Name("self_attn.q_a_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight",
                          "self_attention.q_layernorm.weight", "self_attention.q_layernorm.weight"),
    "q_b_proj": Name("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight"),
    "q_proj": Name("self_attn.q_proj.weight", "self_attention.linear_q_proj.weight", mindspeed_llm=MINDSPEED_LLM_QKV),
    "kv_a_proj": Name("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight",
                      mindspeed_llm=MINDSPEED_LLM_QKV),
    "kv_a_layernorm": Name("self_attn.kv_a_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight",
                           "self_attention.kv_layernorm.weight", "self_attention.kv_layernorm.weight"),
    "kv_b_proj": Name("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight"),
    "o_proj": Name("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
}
# A dense layer's MLP: Megatron fuses gate and up rows into fc1 (and, in the TE spec, the norm into it).
DENSE = {
    "post_attention_layernorm": Name("post_attention_layernorm.weight", "mlp.linear_fc1.layer_norm_weight",
                                     "pre_mlp_layernorm.weight", "pre_mlp_layernorm.weight"),
    "gate_proj": Name("mlp.gate_proj.weight", "mlp.linear_fc1.weight"),
    "up_proj": Name("mlp.up_proj.weight", "mlp.linear_fc1.weight"),
    "down_proj": Name("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
}
# A MoE layer: norm, router and its expert bias, shared experts (fused like a dense MLP).
MOE = {
    "post_attention_layernorm": Name("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    "router": Name("mlp.gate.weight", "mlp.router.weight"),
    "expert_bias": Name("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias"),
    "shared_gate_proj": Name("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.linear_fc1.weight"),
    "shared_up_proj": Name("mlp.shared_experts.up_proj.weight", "mlp.shared_experts.linear_fc1.weight"),
    "shared_down_proj": Name("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight"),
}
# Outside the layers (full names).
EDGES = {
    "embedding": Name("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    "final_norm": Name("model.norm.weight", "decoder.final_layernorm.weight"),
    "output": Name("lm_head.weight", "output_layer.weight"),
}
# vLLM's fused parameters (under HF_LAYER): gate and up rows in one tensor, experts stacked.
VLLM_GATE_UP = "mlp.gate_up_proj.weight"
VLLM_SHARED_GATE_UP = "mlp.shared_experts.gate_up_proj.weight"
VLLM_EXPERTS_W13 = "mlp.experts.w13_weight"
VLLM_EXPERTS_W2 = "mlp.experts.w2_weight"
# Megatron's GroupedMLP storage of the routed experts (under MCORE_LAYER).
MCORE_GROUPED_W1 = "mlp.experts.weight1"
MCORE_GROUPED_W2 = "mlp.experts.weight2"


def local_to_te() -> dict[str, str]:
    """Attention norms the local spec keeps as modules and the TE spec fuses into the next linear.
    (A dense layer's pre-MLP norm differs too, but its local name is also a MoE layer's TE name.)"""
    return {n.local: n.mcore for n in ATTN.values() if n.local is not None}

from verl_patches.reshard.layouts import EXPERT_STORAGES
from verl_patches.reshard.model import LayoutError


def _per_expert_names(prefix: str, storage: str) -> tuple[Any, Any]:
    """Megatron parameter names of local expert j's fc1 / fc2, or (None, None) for GroupedMLP."""
    if storage == "te_grouped":
        return (lambda j: f"{prefix}linear_fc1.weight{j}"), (lambda j: f"{prefix}linear_fc2.weight{j}")
    if storage == "sequential":
        return ((lambda j: f"{prefix}local_experts.{j}.linear_fc1.weight"),
                (lambda j: f"{prefix}local_experts.{j}.linear_fc2.weight"))
    if storage != "grouped":
        raise LayoutError(f"expert storage {storage!r}: expected one of {EXPERT_STORAGES}")
    return None, None


def hf_expert_names(name: str, num_experts: int) -> list[str]:
    """HF per-expert names of a stacked logical expert tensor (model.layers.L.mlp.experts.X.weight)."""
    prefix, _, tail = name.rpartition(".experts.")
    return [f"{prefix}.experts.{j}.{tail}" for j in range(num_experts)]


_EXPERT_STACKS = (".mlp.experts.gate_proj.weight", ".mlp.experts.up_proj.weight",
                  ".mlp.experts.down_proj.weight")


def is_expert_stack(name: str) -> bool:
    """Whether a logical name is a routed-expert stack (model.layers.L.mlp.experts.X.weight)."""
    return name.endswith(_EXPERT_STACKS)
