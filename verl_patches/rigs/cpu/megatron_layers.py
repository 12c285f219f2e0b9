"""Host stand-ins for the Transformer Engine modules of verl's DeepSeek-V3 layer spec (CPU platform only).

verl builds DeepSeek-V3 with megatron-core's Transformer Engine spec (TE's fused norm+linear, flash
attention, grouped-GEMM experts); MindSpeed swaps in its NPU kernels. Neither exists on a host.
``te_layer_spec`` builds the same spec with these modules in TE's places, so the model has TE's
structure and parameter names (``linear_q_up_proj.layer_norm_weight``, ``experts.linear_fc1.weight3``,
...), which verl's weight converter, the reshard binding and megatron's checkpoints then see
exactly as on a GPU. Everything else (MLA, router, dispatcher, shared experts, parallel linears)
is megatron-core's own code.

The math is the textbook one: RMSNorm in fp32, causal softmax attention per packed sequence,
one matmul per expert. With sequence parallelism a norm sees only its rank's slice of the
sequence, so its weight is marked ``sequence_parallel`` and megatron sums its gradient over
tensor parallel, as it does for TE's norms.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F


def _check_rms(config: Any) -> None:
    if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
        raise NotImplementedError(f"the host layer spec implements RMSNorm only (DeepSeek-V3), not "
                                  f"{config.normalization!r}")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def _norm_weight(config: Any, size: int) -> torch.nn.Parameter:
    w = torch.nn.Parameter(torch.ones(size, dtype=config.params_dtype))
    # The norm's input is this rank's slice of the sequence under sequence parallelism.
    setattr(w, "sequence_parallel", bool(config.sequence_parallel))
    return w


class HostNorm(torch.nn.Module):
    """TENorm (RMSNorm)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        _check_rms(config)
        self.eps = eps
        self.weight = _norm_weight(config, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


def _column_parallel_linear():
    # Lazy: megatron-core loads when a layer is built, after the patches on it are applied.
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return ColumnParallelLinear


def layer_norm_column_parallel_linear() -> type:
    """TELayerNormColumnParallelLinear's stand-in: RMSNorm of the input (weight ``layer_norm_weight``),
    then megatron-core's own ColumnParallelLinear (its weight, its sequence-parallel gather). A
    subclass made at first use, so importing this module imports no megatron."""
    global _LNCPL
    if _LNCPL is None:
        base = _column_parallel_linear()

        class HostLayerNormColumnParallelLinear(base):  # type: ignore[misc, valid-type]
            def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
                _check_rms(config)
                super().__init__(input_size, output_size, config=config, **kwargs)
                self.layer_norm_eps = config.layernorm_epsilon
                self.layer_norm_weight = _norm_weight(config, input_size)

            def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                        runtime_gather_output: Optional[bool] = None):
                normed = _rms_norm(input_, self.layer_norm_weight, self.layer_norm_eps)
                return super().forward(normed, weight=weight, runtime_gather_output=runtime_gather_output)

        _LNCPL = HostLayerNormColumnParallelLinear
    return _LNCPL


_LNCPL: Optional[type] = None


class HostCoreAttention(torch.nn.Module):
    """TEDotProductAttention for MLA: causal softmax attention, q/k of one head size, v of another,
    over padded batches [s, b, n, d] or packed sequences (thd, PackedSeqParams.cu_seqlens_q)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: Any = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, **_: Any) -> None:
        super().__init__()
        if getattr(config, "context_parallel_size", 1) > 1:
            raise NotImplementedError("the host attention does not split the sequence over context parallel")
        head = k_channels or config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        # q, k, v: [heads, seq, dim]
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None:
            t = query.shape[0]
            q, k, v = (x.reshape(t, x.shape[-2], x.shape[-1]).transpose(0, 1) for x in (query, key, value))
            out = v.new_zeros(v.shape[0], t, v.shape[-1])
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            for a, b in zip(bounds[:-1], bounds[1:]):
                if b > a:
                    out[:, a:b] = self._attend(q[:, a:b], k[:, a:b], v[:, a:b], None)
            return out.transpose(0, 1).reshape(t, -1)
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, d]
        # megatron's mask marks what must NOT be attended; SDPA's marks what may be.
        mask = None if attention_mask is None else ~attention_mask.bool()
        out = self._attend(q, k, v, mask)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class _HostGroupedLinear(torch.nn.Module):
    """TE's GroupedLinear for the experts: one weight per local expert (``weight<j>``, [out, in]),
    rows of the input split by tokens per expert, one matmul each. Whole experts only (expert
    tensor parallel 1, the recipe's layout)."""

    tp_axis = 0

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any, init_method: Any,
                 bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: Optional[str] = None,
                 **_: Any) -> None:
        super().__init__()
        # Lazy: megatron-core loads when a layer is built, after the patches on it are applied.
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        if bias:
            raise NotImplementedError("expert linears with bias (DeepSeek-V3 has none)")
        if ps.get_expert_tensor_parallel_world_size() != 1:
            raise NotImplementedError("the host grouped linear keeps whole experts: expert_tensor_parallel_size "
                                      "must be 1 (the recipe's layout)")
        self.num_gemms, self.config = num_gemms, config
        expert_parallel = config.expert_model_parallel_size > 1
        for j in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                init_method(w)
            # As TE marks its grouped weights: tensor parallel (size 1) along the split dim, and
            # reduced over the expert data parallel group rather than the dense one.
            set_tensor_model_parallel_attributes(w, True, self.tp_axis, 1)
            setattr(w, "allreduce", not (is_expert and expert_parallel))
            self.register_parameter(f"weight{j}", w)

    def forward(self, x: torch.Tensor, m_splits: list[int]):
        outs = [chunk @ getattr(self, f"weight{j}").t()
                for j, chunk in enumerate(torch.split(x, list(m_splits)))]
        return torch.cat(outs) if outs else x.new_zeros(0, getattr(self, "weight0").shape[0]), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Each local expert as a slice of the global expert axis, replicated over the expert data
        parallel group (what TE's grouped linear writes, without TE's fp8 extra state)."""
        # Lazy: megatron-core loads when a layer is built, after the patches on it are applied.
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = {}
        n_global = ps.get_expert_model_parallel_world_size() * self.num_gemms
        first = ps.get_expert_model_parallel_rank() * self.num_gemms
        ep_axis = len(sharded_offsets)
        for j in range(self.num_gemms):
            sub = make_sharded_tensors_for_checkpoint(
                {f"{j}.weight": getattr(self, f"weight{j}")}, "", {f"{j}.weight": self.tp_axis},
                (*sharded_offsets, (ep_axis, first + j, n_global)))
            replace_prefix_for_sharding(sub, f"{j}.", prefix)
            out[f"{prefix}weight{j}"] = sub[f"{j}.weight"]
        edp = ps.get_expert_data_parallel_rank()
        for sh in out.values():
            sh.replica_id = (*sh.replica_id[:2], edp)
        return out


class HostColumnParallelGroupedLinear(_HostGroupedLinear):
    tp_axis = 0


class HostRowParallelGroupedLinear(_HostGroupedLinear):
    tp_axis = 1


def te_layer_spec(config: Any) -> Any:
    """megatron-core's DeepSeek-V3 decoder block spec in Transformer Engine's structure, with the
    host modules above in TE's places (what verl's DeepseekV3Model asks for on a GPU)."""
    # Lazy: megatron-core loads when a layer is built, after the patches on it are applied.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    if not config.multi_latent_attention:
        raise NotImplementedError("the host layer spec is written for DeepSeek-V3 (multi-latent attention)")
    _check_rms(config)
    ln_linear = layer_norm_column_parallel_linear()
    # The local spec gives megatron's own layer / attention / MoE structure; TE's modules go in.
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    for layer in spec.layer_specs:
        sub = layer.submodules
        sub.input_layernorm = HostNorm
        attn = sub.self_attention.submodules
        attn.linear_q_up_proj = ln_linear if config.qk_layernorm else attn.linear_q_up_proj
        attn.linear_kv_up_proj = ln_linear if config.qk_layernorm else attn.linear_kv_up_proj
        attn.q_layernorm = IdentityOp
        attn.kv_layernorm = IdentityOp
        attn.core_attention = HostCoreAttention
        mlp = sub.mlp
        if mlp.module is MoELayer:
            sub.pre_mlp_layernorm = HostNorm
            mlp.submodules.experts = ModuleSpec(
                module=TEGroupedMLP,
                submodules=MLPSubmodules(linear_fc1=HostColumnParallelGroupedLinear,
                                         linear_fc2=HostRowParallelGroupedLinear))
        elif mlp.module is MLP:
            sub.pre_mlp_layernorm = IdentityOp
            mlp.submodules = MLPSubmodules(linear_fc1=ln_linear, linear_fc2=RowParallelLinear)
        else:
            raise NotImplementedError(f"unexpected MLP module {mlp.module} in megatron's layer spec")
    spec.layer_norm = HostNorm
    return spec
