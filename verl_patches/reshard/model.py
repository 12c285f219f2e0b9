"""The model the reshard moves: DeepSeek-V3's sizes as the reshard needs them, and the error
every layout module raises."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class LayoutError(ValueError):
    """A layout that cannot be built or routed; the message names the parameter and sizes."""


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a HF DeepSeek-V3 config.json that decide tensor shapes."""

    hidden_size: int
    num_layers: int
    first_k_dense: int
    moe_layer_freq: int
    n_routed_experts: int
    n_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    expert_bias: bool  # topk_method == noaux_tc: the router has e_score_correction_bias

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        need = ["hidden_size", "num_hidden_layers", "first_k_dense_replace", "n_routed_experts",
                "moe_intermediate_size", "intermediate_size", "num_attention_heads", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size"]
        missing = [k for k in need if k not in cfg]
        if missing:
            raise LayoutError(f"model config lacks {missing} (a HF DeepSeek-V3 config.json is expected)")
        if cfg.get("quantization_config"):
            raise LayoutError("model config has quantization_config: the reshard moves bf16/fp32 "
                              "weights; convert the FP8 checkpoint and drop quantization_config")
        if int(cfg.get("num_nextn_predict_layers", 0) or 0) != 0:
            raise LayoutError("model config has num_nextn_predict_layers != 0: MTP layers are "
                              "not part of the rollout model; set it to 0")
        if cfg.get("tie_word_embeddings", False):
            raise LayoutError("tie_word_embeddings=True is not supported (DeepSeek-V3 unties them)")
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            first_k_dense=int(cfg["first_k_dense_replace"]),
            moe_layer_freq=int(cfg.get("moe_layer_freq", 1)),
            n_routed_experts=int(cfg["n_routed_experts"]),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=int(cfg["num_attention_heads"]),
            q_lora_rank=None if cfg.get("q_lora_rank") is None else int(cfg["q_lora_rank"]),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            vocab_size=int(cfg["vocab_size"]),
            expert_bias=cfg.get("topk_method") == "noaux_tc",
        )

    @classmethod
    def load(cls, path: str) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf(json.load(f))

    def is_moe(self, layer: int) -> bool:
        # Same rule as vLLM's DeepseekV2DecoderLayer.
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense
                and layer % self.moe_layer_freq == 0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim
