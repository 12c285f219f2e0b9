"""Real megatron-core and vLLM DeepSeek-V3 models on CPU, for the binding tests (spawned processes).

Stand-ins, each declared where it is installed, only for what the CPU build cannot run:
- vLLM: model-class inspection runs in this process (vLLM starts a fresh interpreter for it,
  which lacks the torch 2.5.1 custom-op fix); the platform is vLLM's own CpuPlatform marked
  out-of-tree, as vLLM-Ascend's is, so custom ops take their native torch path instead of the
  compiled torch.ops._C kernels this build lacks; vllm.attention.ops.triton_flash_attention, a
  GPU kernel module that probes the CUDA device at import, is an empty module.
- megatron-core: torch.cuda.current_device answers "cpu"; the parameter-free core attention is
  a stub (the local DotProductAttention does not take MLA's arguments); GroupedMLP's check for
  the grouped_gemm CUDA package passes (its weights are plain parameters; no GEMM runs here).
Every module that holds weights is the real upstream one.
"""

from __future__ import annotations

import json
import sys
import types
import zlib
from pathlib import Path
from typing import Any

import torch

from verl_patches.reshard import deepseek_v3_names as names
from verl_patches.rigs.testing.upstream_env import prepare_cpu_upstream
import torch.distributed as dist


def write_model_dir(d: Path, config: dict[str, Any]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


def vllm_cpu_stand_ins() -> None:
    prepare_cpu_upstream()
    # Lazy: vLLM and megatron-core load inside the rank that builds the model, after the patches are applied.
    import vllm.model_executor.models.registry as registry
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import PlatformEnum

    registry._run_in_subprocess = lambda fn: fn()  # stand-in: inspect in this process

    class OutOfTreeCpu(CpuPlatform):  # stand-in: vLLM's CPU platform, out-of-tree like vLLM-Ascend
        _enum = PlatformEnum.OOT

    platforms._current_platform = OutOfTreeCpu()
    name = "vllm.attention.ops.triton_flash_attention"
    if name not in sys.modules:  # stand-in: GPU kernel module
        mod = types.ModuleType(name)
        mod.triton_attention = None
        sys.modules[name] = mod


def build_vllm_deepseek(model_dir: Path, dtype: torch.dtype, tp: int = 1) -> tuple[Any, Any]:
    """vLLM 0.9.1's DeepseekV3ForCausalLM with expert parallel over the TP group, on the default
    process group (gloo); returns (model, vllm_config)."""
    # Lazy: vLLM and megatron-core load inside the rank that builds the model, after the patches are applied.
    from vllm.config import (DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed import parallel_state as ps

    mc = ModelConfig(model=str(model_dir), tokenizer=None, skip_tokenizer_init=True,
                     dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype], max_model_len=128,
                     enforce_eager=True)
    mc.use_async_output_proc = False
    cfg = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"),
                     parallel_config=ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=True),
                     load_config=LoadConfig(load_format="dummy"))
    # Lazy: vLLM and megatron-core load inside the rank that builds the model, after the patches are applied.
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

    with set_current_vllm_config(cfg):
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(dist.get_world_size(), dist.get_rank(), "env://", dist.get_rank(), "gloo")
            ps.initialize_model_parallel(tp, 1, backend="gloo")
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = DeepseekV3ForCausalLM(vllm_config=cfg)
        finally:
            torch.set_default_dtype(old)
    return model, cfg


def vllm_post_load(model: Any, cfg: Any) -> None:
    """What vLLM's loader runs once after loading weights."""
    # Lazy: vLLM and megatron-core load inside the rank that builds the model, after the patches are applied.
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))


def megatron_cpu_stand_ins() -> None:
    torch.cuda.current_device = lambda: "cpu"  # stand-in
    torch.cuda.synchronize = lambda *a, **k: None  # stand-in
    # Lazy: vLLM and megatron-core load inside the rank that builds the model, after the patches are applied.
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None  # stand-in: no GEMM runs here


def build_megatron_deepseek(cfg: dict[str, Any], dtype: torch.dtype, grouped: bool,
                            layers: tuple[int, ...] = (), *, core_attention: type | None = None,
                            config_overrides: dict[str, Any] | None = None) -> Any:
    """megatron-core 0.12.1 GPTModel with MLA and MoE, local spec: GroupedMLP (grouped=True) or
    SequentialMLP experts, this rank's pipeline stage. Parallel state must be initialised (its
    TP / PP / expert sizes are used); ``layers``: per-stage layer counts, uneven first / last
    stages only (what megatron-core 0.12.1 supports natively). ``core_attention``: the attention
    kernel module (default a parameter-free stand-in without a forward, for weight work only);
    ``config_overrides``: more MLATransformerConfig fields (dropout off for a training comparison)."""
    # Lazy: vLLM and megatron-core load inside the rank that builds the model, after the patches are applied.
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    n = cfg["num_hidden_layers"]
    pp = mpu.get_pipeline_model_parallel_world_size()
    uneven: dict[str, Any] = {}
    if layers and pp > 1:
        if len(set(layers[1:-1])) > 1:
            raise ValueError(f"layers {layers}: megatron-core 0.12.1 splits the middle stages evenly")
        uneven = dict(num_layers_in_first_pipeline_stage=layers[0])
        if pp > 2:  # with two stages megatron-core 0.12.1 takes the first count only (no middle to split)
            uneven["num_layers_in_last_pipeline_stage"] = layers[-1]
    tc = MLATransformerConfig(
        tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(), pipeline_model_parallel_size=pp,
        expert_model_parallel_size=mpu.get_expert_model_parallel_world_size(), expert_tensor_parallel_size=1,
        pipeline_dtype=dtype, sequence_parallel=mpu.get_tensor_model_parallel_world_size() > 1, **uneven,
        num_layers=n, hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"], moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        q_lora_rank=cfg["q_lora_rank"], kv_lora_rank=cfg["kv_lora_rank"], qk_head_dim=cfg["qk_nope_head_dim"],
        qk_pos_emb_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
        num_moe_experts=cfg["n_routed_experts"],
        moe_layer_freq=[0 if i < cfg["first_k_dense_replace"] else 1 for i in range(n)],
        moe_shared_expert_intermediate_size=cfg["moe_intermediate_size"] * cfg["n_shared_experts"],
        moe_router_topk=cfg["num_experts_per_tok"], moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, rope_type="rope", qk_layernorm=True, moe_grouped_gemm=grouped,
        moe_token_dispatcher_type="allgather",  # the alltoall dispatcher makes a CUDA stream; no weights either way
        **(config_overrides or {}))
    # Megatron demands sequence parallel with TP x EP, which its torch norms (local spec) refuse;
    # it splits activations only, so it is switched off after the config check (no weights change).
    tc.sequence_parallel = False
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False)

    class CoreAttentionStub(torch.nn.Module):  # stand-in: parameter-free
        def __init__(self, *args, **kwargs):
            super().__init__()

    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = core_attention or CoreAttentionStub
    return GPTModel(tc, spec, vocab_size=cfg["vocab_size"], max_sequence_length=128, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False,
                    pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Seeded values in every parameter and the router's expert bias (a buffer)."""
    for name, t in list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers()
                                                       if n.endswith("router.expert_bias")]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        t.data.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def megatron_to_hf(model: torch.nn.Module, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The HF state of a single-rank megatron-core GPTModel (local spec), written from megatron's
    module semantics, independently of the reshard layout: fused fc1 = [gate; up] rows; GroupedMLP
    keeps weight1 as view(experts, hidden, 2 * I) and weight2 as view(experts, I, hidden), used
    as x @ w (GroupedMLP.forward), i.e. transposed relative to HF."""
    sd = {n: t for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
    H, Im, I = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    E = cfg["n_routed_experts"]
    out = {n.hf: sd[n.mcore] for n in names.EDGES.values()}
    # The test models use the local spec and a query LoRA rank (no q_proj).
    attn = [n for k, n in names.ATTN.items() if k != "q_proj"]
    for L in range(cfg["num_hidden_layers"]):
        m, h = names.MCORE_LAYER.format(L), names.HF_LAYER.format(L)
        for n in attn:
            out[h + n.hf] = sd[m + n.mcore_for("local")]
        out[h + names.DENSE["post_attention_layernorm"].hf] = sd[m + names.DENSE["post_attention_layernorm"].local]

        def glu(w: torch.Tensor, n: int, prefix: str, down: torch.Tensor) -> None:
            out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = w[:n], w[n:]
            out[prefix + "down_proj.weight"] = down

        if L < cfg["first_k_dense_replace"]:
            glu(sd[m + names.DENSE["gate_proj"].mcore], I, h + "mlp.", sd[m + names.DENSE["down_proj"].mcore])
            continue
        for key in ("router", "expert_bias"):
            out[h + names.MOE[key].hf] = sd[m + names.MOE[key].mcore]
        glu(sd[m + names.MOE["shared_gate_proj"].mcore], Im * cfg["n_shared_experts"], h + "mlp.shared_experts.",
            sd[m + names.MOE["shared_down_proj"].mcore])
        for j in range(E):
            if m + names.MCORE_GROUPED_W1 in sd:
                w1 = sd[m + names.MCORE_GROUPED_W1].view(E, H, 2 * Im)[j].t()
                w2 = sd[m + names.MCORE_GROUPED_W2].view(E, Im, H)[j].t()
            else:
                w1 = sd[m + f"mlp.experts.local_experts.{j}.linear_fc1.weight"]
                w2 = sd[m + f"mlp.experts.local_experts.{j}.linear_fc2.weight"]
            glu(w1, Im, h + f"mlp.experts.{j}.", w2)
    return {k: v.contiguous() for k, v in out.items()}


def mla_derived(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What vLLM's MLA implementations derive from kv_b_proj after loading (W_UK_T, W_UV)."""
    # Lazy: vLLM and megatron-core load inside the rank that builds the model, after the patches are applied.
    from vllm.attention import Attention

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention) and getattr(module, "use_mla", False):
            for attr in ("W_UK_T", "W_UV"):
                out[f"{name}.impl.{attr}"] = getattr(module.impl, attr).clone()
    return out
