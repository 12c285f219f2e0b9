"""The recipe's Megatron / MindSpeed training settings (``recipe.megatron``): parse, check, map.

Framework-free: turns the YAML section into MindSpeed argument names, TransformerConfig
overrides and per-stage layer spans, and rejects bad combinations with messages naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

SECTION = "actor_rollout_ref.rollout.recipe.megatron"
# recipe key -> MindSpeed argument (its --flag with dashes as underscores, as argparse stores it).
# Names from MindSpeed's own parsers: mindspeed/arguments.py (--use-fused-swiglu,
# --use-fused-rotary-pos-emb, --moe-tp-extend-ep), features_manager/optimizer/swap_optimizer_feature.py
# (--swap-optimizer), features_manager/transformer/flash_attention/fusion_attention_v1_feature.py
# (feature "use-flash-attn"), MindSpeed-LLM's NumLayerListFeature (--num-layer-list, "7,7,8,...").
# The fusion and overlap flags after them are the rest of the reference run's MindSpeed flags, each an
# argument of the release's mindspeed/arguments.py or a feature of its features manager
# (tests/patches/mindspeed/test_mindspeed_release.py checks every name against the installed release).
MINDSPEED_ARG = {
    "moe_tp_extend_ep": "moe_tp_extend_ep",
    "swap_optimizer": "swap_optimizer",
    "use_flash_attn": "use_flash_attn",
    "use_fused_rotary_pos_emb": "use_fused_rotary_pos_emb",
    "use_fused_swiglu": "use_fused_swiglu",
    "use_fused_rmsnorm": "use_fused_rmsnorm",
    "moe_permutation_async_comm": "moe_permutation_async_comm",
    "moe_alltoall_overlap_comm": "moe_alltoall_overlap_comm",
    "use_fused_moe_token_permute_and_unpermute": "use_fused_moe_token_permute_and_unpermute",
    "gemm_gradient_accumulation_fusion": "gemm_gradient_accumulation_fusion",
    "num_layer_list": "num_layer_list",
}
_BOOL_KEYS = ("moe_tp_extend_ep", "swap_optimizer", "use_flash_attn", "use_fused_rotary_pos_emb", "use_fused_swiglu",
              "use_fused_rmsnorm", "moe_permutation_async_comm", "moe_alltoall_overlap_comm",
              "use_fused_moe_token_permute_and_unpermute", "gemm_gradient_accumulation_fusion")


class RecipeMegatronError(ValueError):
    """recipe.megatron is malformed or disagrees with the training layout; the message names the key."""


@dataclass(frozen=True)
class RecipeMegatron:
    num_layer_list: tuple[int, ...] | None = None
    moe_tp_extend_ep: bool = False
    swap_optimizer: bool = False
    use_flash_attn: bool = False
    use_fused_rotary_pos_emb: bool = False
    use_fused_swiglu: bool = False
    use_fused_rmsnorm: bool = False
    moe_permutation_async_comm: bool = False
    moe_alltoall_overlap_comm: bool = False
    use_fused_moe_token_permute_and_unpermute: bool = False
    gemm_gradient_accumulation_fusion: bool = False


def _layer_count(x: Any) -> bool:
    if isinstance(x, str):
        return x.isdigit() and int(x) >= 1
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def parse(section: Mapping[str, Any] | None) -> RecipeMegatron:
    """The section as typed values; unknown keys and wrong types are errors."""
    if section is None:
        return RecipeMegatron()
    problems = []
    unknown = sorted(set(section) - set(MINDSPEED_ARG))
    if unknown:
        problems.append(f"unknown key(s) {unknown}; known: {sorted(MINDSPEED_ARG)}")
    values: dict[str, Any] = {}
    for key in _BOOL_KEYS:
        v = section.get(key, False)
        if v is None:
            v = False
        if not isinstance(v, bool):
            problems.append(f"{key} must be true or false, got {v!r}")
        values[key] = bool(v)
    lst = section.get("num_layer_list")
    if lst is not None:
        if isinstance(lst, str):
            lst = [x.strip() for x in lst.split(",") if x.strip()]
        try:
            items = list(lst)
        except TypeError:
            items = None
        if items is None or not items:
            problems.append(f"num_layer_list must be a non-empty list of layer counts, got {lst!r}")
        else:
            bad = [x for x in items if not _layer_count(x)]
            if bad:
                problems.append(f"num_layer_list entries must be integers >= 1, got {bad[0]!r} in {items}")
            else:
                values["num_layer_list"] = tuple(int(x) for x in items)
    if problems:
        raise RecipeMegatronError(f"{SECTION}: " + "; ".join(problems))
    return RecipeMegatron(**values)


def check_layout(recipe: RecipeMegatron, *, num_layers: int, pp: int, vpp: int | None = None,
                 tp: int = 1, ep: int = 1, etp: int | None = None, num_experts: int | None = None) -> None:
    """Raise RecipeMegatronError when the section disagrees with the model or the parallel layout."""
    problems = []
    lst = recipe.num_layer_list
    if lst is not None:
        if len(lst) != pp:
            problems.append(f"num_layer_list has {len(lst)} stages, pipeline_model_parallel_size is {pp}")
        if sum(lst) != num_layers:
            problems.append(f"num_layer_list {list(lst)} sums to {sum(lst)}, the model has {num_layers} layers")
        if vpp is not None and vpp > 1:
            problems.append(f"num_layer_list does not support virtual pipeline stages (virtual_pipeline_model_parallel_size={vpp})")
    if recipe.moe_alltoall_overlap_comm and not recipe.moe_tp_extend_ep:
        # MindSpeed's MoEAlltoAllSeqOverLapFeature: overlap exists for its alltoall_seq dispatcher with TP
        # folded into the expert group; megatron-core's own EP folding (the recipe's) has no such overlap.
        problems.append("moe_alltoall_overlap_comm needs moe_tp_extend_ep (MindSpeed's alltoall_seq overlap)")
    if recipe.moe_tp_extend_ep:
        if etp not in (None, 1):
            problems.append("moe_tp_extend_ep splits experts over the TP x EP group with no expert TP: "
                            f"expert_tensor_parallel_size must be 1, got {etp}")
        if num_experts is not None and num_experts % (tp * ep):
            problems.append(f"moe_tp_extend_ep: {num_experts} routed experts do not divide over TP{tp} x EP{ep} = {tp * ep} ranks")
    if problems:
        raise RecipeMegatronError(f"{SECTION}: " + "; ".join(problems))


def stage_span(num_layer_list: tuple[int, ...] | list[int], pp_rank: int) -> tuple[int, int]:
    """(global index of the stage's first layer, number of layers) for one pipeline stage."""
    if not 0 <= pp_rank < len(num_layer_list):
        raise RecipeMegatronError(f"{SECTION}.num_layer_list has {len(num_layer_list)} stages, no stage {pp_rank}")
    return sum(num_layer_list[:pp_rank]), num_layer_list[pp_rank]


def is_uneven(recipe: RecipeMegatron) -> bool:
    return recipe.num_layer_list is not None and len(set(recipe.num_layer_list)) > 1


def mindspeed_args(recipe: RecipeMegatron) -> dict[str, Any]:
    """MindSpeed argument values (argparse dest names) for the section.

    moe_tp_extend_ep (and the alltoall overlap) bring what MindSpeed's MoETpExtendEpFeature and
    MoEAlltoAllSeqOverLapFeature require with them (--moe-permutation-async-comm and
    --moe-grouped-gemm); the layer list is the
    comma-separated string --num-layer-list takes.
    """
    out: dict[str, Any] = {MINDSPEED_ARG[k]: getattr(recipe, k) for k in _BOOL_KEYS}
    if recipe.moe_tp_extend_ep or recipe.moe_alltoall_overlap_comm:
        out["moe_permutation_async_comm"] = True
        out["moe_grouped_gemm"] = True
    if recipe.num_layer_list is not None:
        out[MINDSPEED_ARG["num_layer_list"]] = ",".join(str(n) for n in recipe.num_layer_list)
    return out


def transformer_config_overrides(recipe: RecipeMegatron) -> dict[str, Any]:
    """The part megatron-core's TransformerConfig has a field for (given to override_transformer_config).

    Only the fused SwiGLU has one (bias_activation_fusion: MindSpeed swaps in its kernel under
    it). Fused RoPE has no megatron-side equivalent for MLA (TransformerConfig rejects
    apply_rope_fusion with multi_latent_attention), flash attention is the attention backend
    verl picks, and moe_tp_extend_ep / swap_optimizer exist only in MindSpeed.
    """
    # Only switched on: with the flag off, verl's own choice for the model stays.
    return {"bias_activation_fusion": True} if recipe.use_fused_swiglu else {}


def merge_overrides(user: Mapping[str, Any] | None, ours: Mapping[str, Any]) -> dict[str, Any]:
    """``ours`` under the user's override_transformer_config: an explicit user entry wins."""
    return {**dict(ours), **dict(user or {})}


def deepseek_v3_overrides(hf: Mapping[str, Any]) -> dict[str, Any]:
    """TransformerConfig values verl 0.4.1's hf_to_mcore_config_dpskv3 leaves out or misreads.

    - Group-limited routing: DeepSeek-V3 picks topk_group of n_group expert groups per token
      (by the sum of each group's top-2 scores) before its top-8 experts; megatron-core 0.12
      does exactly this with moe_router_num_groups / moe_router_group_topk (group score =
      sum of top-(topk / group_topk) = top-2), which verl never sets: without them every
      token may route to any expert.
    - RoPE type: verl reads rope_scaling["type"] only; a config that names it "rope_type"
      alone would silently get plain RoPE instead of YaRN.
    megatron-core's sigmoid router always renormalises the top-k scores, so a config with
    norm_topk_prob false cannot be expressed and is refused.
    """
    out: dict[str, Any] = {}
    n_group, topk_group = hf.get("n_group"), hf.get("topk_group")
    if n_group and n_group > 1:
        if not topk_group:
            raise RecipeMegatronError(f"model config: n_group={n_group} without topk_group")
        out["moe_router_num_groups"] = int(n_group)
        out["moe_router_group_topk"] = int(topk_group)
    rope = hf.get("rope_scaling") or {}
    if "type" not in rope and rope.get("rope_type") in ("yarn", "rope", "default"):
        out["rope_type"] = "yarn" if rope["rope_type"] == "yarn" else "rope"
    if hf.get("norm_topk_prob") is False and (hf.get("num_experts_per_tok") or 1) > 1:
        raise RecipeMegatronError("model config: norm_topk_prob=false is not expressible in megatron-core 0.12's "
                                  "sigmoid router (it always renormalises the top-k scores)")
    return out



# The reference recipe's route on Ascend: Megatron's global arguments from verl's config (the model's HF config,
# the parallel layout, the recipe's MindSpeed flags) through MindSpeed-LLM's argument parser, whose command line
# this builds. The model's shape comes from the HF config; the layer spec is MindSpeed-LLM's DeepSeek spec.
_DEEPSEEK_SWITCHES = ("use-mcore-models", "multi-latent-attention", "qk-layernorm", "swiglu", "disable-bias-linear",
                      "untie-embeddings-and-output-weights", "use-cpu-initialization",
                      "no-gradient-accumulation-fusion", "attention-softmax-in-fp32", "no-masked-softmax-fusion")
DEEPSEEK_SPEC = ("mindspeed_llm.tasks.models.spec.deepseek_spec", "layer_spec")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def megatron_argv(hf: Mapping[str, Any], recipe: RecipeMegatron | None = None, *, seq_length: int,
                  micro_batch_size: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                  cp: int = 1, dtype: str = "bf16", cpu_initialization: bool = True) -> list[str]:
    """MindSpeed-LLM's / Megatron's command line for DeepSeek-V3 from its HF config (a dict of config.json),
    the parallel layout and ``recipe.megatron`` (its MindSpeed flags, as ``mindspeed_args`` maps them).

    Refuses a config that is not DeepSeek-V3-shaped (it names the missing key) and a dtype other than bf16 /
    fp16 / fp32. The MoE dispatcher is megatron-core's alltoall (the recipe's); the spec is MindSpeed-LLM's.
    """
    need = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "max_position_embeddings",
            "vocab_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
            "first_k_dense_replace", "rms_norm_eps", "rope_theta")
    missing = [k for k in need if hf.get(k) is None]
    if missing:
        raise RecipeMegatronError(f"model config: {missing} missing; MindSpeed-LLM's DeepSeek arguments need them")
    if dtype not in ("bf16", "fp16", "fp32"):
        raise RecipeMegatronError(f"dtype must be bf16, fp16 or fp32, got {dtype!r}")
    flags: dict[str, Any] = {
        "num-layers": hf["num_hidden_layers"], "hidden-size": hf["hidden_size"],
        "ffn-hidden-size": hf["intermediate_size"], "num-attention-heads": hf["num_attention_heads"],
        "seq-length": seq_length, "max-position-embeddings": hf["max_position_embeddings"],
        "micro-batch-size": micro_batch_size, "vocab-size": hf["vocab_size"], "make-vocab-size-divisible-by": 1,
        "padded-vocab-size": hf["vocab_size"], "q-lora-rank": hf["q_lora_rank"], "kv-lora-rank": hf["kv_lora_rank"],
        "qk-rope-head-dim": hf["qk_rope_head_dim"], "qk-nope-head-dim": hf["qk_nope_head_dim"],
        "v-head-dim": hf["v_head_dim"], "num-experts": hf["n_routed_experts"],
        "moe-router-topk": hf["num_experts_per_tok"], "moe-ffn-hidden-size": hf["moe_intermediate_size"],
        "n-shared-experts": hf["n_shared_experts"], "first-k-dense-replace": hf["first_k_dense_replace"],
        "moe-layer-freq": 1, "moe-router-score-function": hf.get("scoring_func", "sigmoid"),
        "moe-token-dispatcher-type": "alltoall", "normalization": "RMSNorm", "norm-epsilon": hf["rms_norm_eps"],
        "position-embedding-type": "rope", "rotary-base": hf["rope_theta"], "tokenizer-type": "NullTokenizer",
        "transformer-impl": "local", "tensor-model-parallel-size": tp, "pipeline-model-parallel-size": pp,
        "expert-model-parallel-size": ep, "context-parallel-size": cp,
    }
    if etp is not None:
        flags["expert-tensor-parallel-size"] = etp
    switches = list(_DEEPSEEK_SWITCHES)
    if not cpu_initialization:
        switches.remove("use-cpu-initialization")
    if dtype != "fp32":
        switches.append(dtype)
    switches += ["moe-grouped-gemm", "moe-router-enable-expert-bias"]
    if hf.get("topk_method") == "noaux_tc" and "moe-router-enable-expert-bias" not in switches:
        switches.append("moe-router-enable-expert-bias")
    for dest, value in mindspeed_args(recipe or RecipeMegatron()).items():
        if isinstance(value, bool):
            if value and _flag(dest)[2:] not in switches:
                switches.append(_flag(dest)[2:])
        elif value is not None:
            flags[_flag(dest)[2:]] = value
    argv = [x for k, v in flags.items() for x in (f"--{k}", str(v))] + [f"--{s}" for s in switches]
    return argv + ["--spec", *DEEPSEEK_SPEC]


# What the recipe asks MindSpeed for in this process; the NPU-only patch on MindSpeed's
# argument parser reads it when MindSpeed parses its arguments.
_PENDING_MINDSPEED: dict[str, Any] = {}


def set_pending_mindspeed_args(values: Mapping[str, Any]) -> None:
    _PENDING_MINDSPEED.clear()
    _PENDING_MINDSPEED.update(values)


def pending_mindspeed_args() -> dict[str, Any]:
    return dict(_PENDING_MINDSPEED)
