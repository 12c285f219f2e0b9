"""Tiny synthetic DeepSeek-V3 HF checkpoints (names and shapes of the real model, random values) for the tool tests.

Built from configs/model/tiny_deepseek_v3.json when present, else from the same numbers inline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TINY = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "first_k_dense_replace": 1,
    "hidden_size": 64, "intermediate_size": 96, "kv_lora_rank": 32, "max_position_embeddings": 2048,
    "moe_intermediate_size": 32, "n_routed_experts": 16, "n_shared_experts": 1, "num_attention_heads": 8,
    "num_experts_per_tok": 4, "num_hidden_layers": 4, "num_key_value_heads": 8, "num_nextn_predict_layers": 0,
    "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 1000,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def tiny_config(**overrides) -> dict:
    path = REPO / "configs" / "model" / "tiny_deepseek_v3.json"
    cfg = json.loads(path.read_text()) if path.is_file() else dict(TINY)
    cfg.update(overrides)
    return cfg


def layer_shapes(cfg: dict, layer: int) -> dict[str, tuple[int, ...]]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    p = f"model.layers.{layer}."
    s = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_a_proj.weight": (cfg["q_lora_rank"], h),
        p + "self_attn.q_a_layernorm.weight": (cfg["q_lora_rank"],),
        p + "self_attn.q_b_proj.weight": (heads * qk, cfg["q_lora_rank"]),
        p + "self_attn.kv_a_proj_with_mqa.weight": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
        p + "self_attn.kv_a_layernorm.weight": (cfg["kv_lora_rank"],),
        p + "self_attn.kv_b_proj.weight": (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]),
        p + "self_attn.o_proj.weight": (h, heads * cfg["v_head_dim"]),
    }
    if layer < cfg["first_k_dense_replace"]:
        i = cfg["intermediate_size"]
        s.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)})
    else:
        e, i = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        si = i * cfg["n_shared_experts"]
        s.update({p + "mlp.gate.weight": (e, h), p + "mlp.gate.e_score_correction_bias": (e,),
                  p + "mlp.shared_experts.gate_proj.weight": (si, h), p + "mlp.shared_experts.up_proj.weight": (si, h),
                  p + "mlp.shared_experts.down_proj.weight": (h, si)})
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            s.update({q + "gate_proj.weight": (i, h), q + "up_proj.weight": (i, h), q + "down_proj.weight": (h, i)})
    return s


def model_shapes(cfg: dict, with_mtp: bool = False) -> dict[str, tuple[int, ...]]:
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    s = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    layers = cfg["num_hidden_layers"] + (1 if with_mtp else 0)
    for layer in range(layers):
        s.update(layer_shapes(cfg, layer))
    return s


def is_quantized(name: str) -> bool:
    """What DeepSeek's release stores in FP8: the 2-D projection weights inside layers, not norms or the router."""
    return ".layers." in name and name.endswith("proj.weight") or (".experts." in name and name.endswith(".weight")
                                                                   and "layernorm" not in name)


def write_hf(path: Path, tensors: dict[str, torch.Tensor], cfg: dict, shards: int = 2) -> None:
    """Safetensors shards + index + config.json + a tokenizer stand-in, as in a HF model directory."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for k in range(shards):
        chunk = names[k * per:(k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in chunk}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer.json").write_text('{"stand-in": true}')


def random_bf16(cfg: dict, seed: int = 0, with_mtp: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n, shape in model_shapes(cfg, with_mtp).items()}
