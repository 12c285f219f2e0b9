"""Host implementations of the torch_npu operators and MindSpeed kernels the DeepSeek-V3 training
path calls, one module per family, their tables assembled here: a declared stand-in of the NPU's kernels for the NPU rehearsal platform, used only when
that platform is selected (the stand-in ``torch_npu`` package looks operators up in ``OPERATORS``;
MindSpeed's op builders are answered from ``MINDSPEED_KERNELS``), never where the real torch_npu
imports.

What it proves: the math of each operator as torch_npu / CANN document it (layouts, scale, masks,
sparse modes, return tuples, the backward where the path calls it), each checked on its own against
an independent plain-torch reference in ``tests/npu_rehearsal/test_ops.py``. What it does not prove:
the NPU's kernels, the precision of their own accumulation and rounding (here: plain torch in fp32,
cast back to the input dtype, where the NPU kernels accumulate in fp32), their speed or memory, and
the NPU's dropout random stream.

Call forms follow the callers in MindSpeed 2.2.0 (``mindspeed/ops/*.py``, ``mindspeed/te/pytorch``,
``mindspeed/core``) and MindSpeed-LLM 2.2.0. Every operator validates its input and raises
``ValueError`` naming the argument and the rule; what the stand-in does not implement (a layout,
sparse mode or option the path does not use) is rejected the same way, never silently accepted.

What MindSpeed / MindSpeed-LLM call that is not implemented is absent from the two tables (so the
stand-in package fails naming it) and listed with its reason in ``NOT_IMPLEMENTED`` (torch_npu
operators: the HCCL-fused matmuls, inference attention, ``npu_fusion_attention_v2``, ...) and
``MINDSPEED_KERNELS_NOT_IMPLEMENTED`` (MindSpeed op builders).

The modules: ``common`` (constants and input checks), ``rms_norm``, ``rotary``, ``swiglu``, ``softmax`` (scaled
masked softmax), ``attention`` (fused attention), ``grouped_matmul``, ``moe_permute`` (with a routing map) and
``mindspeed_kernels`` (MindSpeed's compiled kernels, the index-based permute among them, and torch_npu's
``npu_apply_adam_w``). An operator lives in one module and is listed in one table here.
"""

from __future__ import annotations

from typing import Callable

from verl_patches.rigs.npu_rehearsal.ops.common import INT_MAX, COMPRESSED_MASK_SIZE  # noqa: F401
from verl_patches.rigs.npu_rehearsal.ops.rms_norm import npu_rms_norm  # noqa: F401
from verl_patches.rigs.npu_rehearsal.ops.rotary import npu_rotary_mul, npu_rotary_position_embedding  # noqa: F401
from verl_patches.rigs.npu_rehearsal.ops.swiglu import npu_swiglu, npu_swiglu_backward  # noqa: F401
from verl_patches.rigs.npu_rehearsal.ops.softmax import (  # noqa: F401
    SCALED_MASKED_SOFTMAX_FILL, npu_scaled_masked_softmax,
)
from verl_patches.rigs.npu_rehearsal.ops.attention import (  # noqa: F401
    LAYOUTS, npu_fusion_attention, npu_fusion_attention_grad,
)
from verl_patches.rigs.npu_rehearsal.ops.grouped_matmul import npu_grouped_matmul  # noqa: F401
from verl_patches.rigs.npu_rehearsal.ops.moe_permute import (  # noqa: F401
    npu_moe_token_permute_with_routing_map, npu_moe_token_permute_with_routing_map_grad,
    _npu_moe_token_unpermute_with_routing_map, npu_moe_token_unpermute_with_routing_map,
    npu_moe_token_unpermute_with_routing_map_grad,
)
from verl_patches.rigs.npu_rehearsal.ops.mindspeed_kernels import (  # noqa: F401
    _gmm_kernel, npu_matmul_add_fp32, npu_groupmatmul_add_fp32, npu_moe_token_permute, npu_moe_token_unpermute,
    npu_apply_fused_adamw_v2, npu_apply_adam_w,
)


OPERATORS: dict[str, Callable] = {
    "npu_rms_norm": npu_rms_norm,
    "npu_apply_adam_w": npu_apply_adam_w,
    "npu_rotary_mul": npu_rotary_mul,
    "npu_rotary_position_embedding": npu_rotary_position_embedding,
    "npu_swiglu": npu_swiglu,
    "npu_swiglu_backward": npu_swiglu_backward,
    "npu_scaled_masked_softmax": npu_scaled_masked_softmax,
    "npu_fusion_attention": npu_fusion_attention,
    "npu_fusion_attention_grad": npu_fusion_attention_grad,
    "npu_grouped_matmul": npu_grouped_matmul,
    "npu_moe_token_permute_with_routing_map": npu_moe_token_permute_with_routing_map,
    "npu_moe_token_permute_with_routing_map_grad": npu_moe_token_permute_with_routing_map_grad,
    "npu_moe_token_unpermute_with_routing_map": npu_moe_token_unpermute_with_routing_map,
    "_npu_moe_token_unpermute_with_routing_map": _npu_moe_token_unpermute_with_routing_map,
    "npu_moe_token_unpermute_with_routing_map_grad": npu_moe_token_unpermute_with_routing_map_grad,
}
"""torch_npu attribute name -> host implementation, for operators called as ``torch_npu.<name>``."""

MINDSPEED_KERNELS: dict[str, dict[str, Callable]] = {
    "grouped_matmul": _gmm_kernel(0),
    "grouped_matmul_v2": _gmm_kernel(1),
    "npu_matmul_add_fp32": {"npu_matmul_add_fp32": npu_matmul_add_fp32},
    "npu_groupmatmul_add_fp32": {"npu_groupmatmul_add_fp32": npu_groupmatmul_add_fp32},
    "npu_moe_token_permute": {"npu_moe_token_permute": npu_moe_token_permute},
    "npu_moe_token_unpermute": {"npu_moe_token_unpermute": npu_moe_token_unpermute},
    "npu_rotary_position_embedding": {
        "npu_rotary_position_embedding": npu_rotary_position_embedding},
    "npu_apply_fused_adamw_v2": {"npu_apply_fused_adamw_v2": npu_apply_fused_adamw_v2},
}
"""MindSpeed op builder NAME (``GMMOpBuilder`` "grouped_matmul", ``GMMV2OpBuilder``
"grouped_matmul_v2", ``MatmulAddOpBuilder``, ``GroupMatmulAddOpBuilder``,
``MoeTokenPermuteOpBuilder``, ``MoeTokenUnpermuteOpBuilder``, ``RotaryPositionEmbeddingOpBuilder``,
``FusedAdamWV2OpBuilder``) -> {function the ``mindspeed/ops`` wrapper calls on the loaded module ->
host implementation}. Not provided: ``swiglu`` / ``rms_norm`` (``SwigluOpBuilder``,
``RmsNormOpBuilder``: no caller in MindSpeed 2.2.0 loads them; the path calls torch_npu's
``npu_swiglu`` / ``npu_rms_norm``), ``fusion_attention_v2`` (ALiBi ``pse`` only), quantised GMMs,
communication-fused and ring-attention-update kernels."""

NOT_IMPLEMENTED: dict[str, str] = {
    "npu_all_gather_base_mm": "fuses an HCCL all-gather into the matmul (MindSpeed's MC2 / CoC "
                              "tensor parallelism); needs HCCL",
    "npu_mm_reduce_scatter_base": "fuses an HCCL reduce-scatter into the matmul (MC2 / CoC); "
                                  "needs HCCL",
    "npu_prompt_flash_attention": "inference attention (generation), not the training path",
    "npu_incre_flash_attention": "inference attention (generation), not the training path",
    "npu_fusion_attention_v2": "MindSpeed-LLM calls it only with --mla-fa-divide-qk, which the "
                               "recipe does not set",
    "npu_apply_fused_ema_adamw": "the EMA AdamW optimizer, which the recipe does not select",
    "npu_hans_encode": "checkpoint compression, not the training path",
    "npu_hans_decode": "checkpoint compression, not the training path",
}
"""torch_npu operators MindSpeed 2.2.0 / MindSpeed-LLM 2.2.0 call that the stand-in does not
implement, with the reason; the stand-in package names the operator (and this reason) when asked
for one, instead of a no-op."""

MINDSPEED_KERNELS_NOT_IMPLEMENTED: dict[str, str] = {
    "swiglu": "no caller loads SwigluOpBuilder in MindSpeed 2.2.0 (the path calls "
              "torch_npu.npu_swiglu)",
    "rms_norm": "no caller loads RmsNormOpBuilder in MindSpeed 2.2.0 (the path calls "
                "torch_npu.npu_rms_norm)",
    "fusion_attention_v2": "MindSpeed's --use-fusion-attn-v2 (ALiBi pse) only",
    "npu_ring_attention_update": "ring context parallelism (context_parallel_size > 1) only",
    "quant_grouped_matmul": "quantised grouped matmul, not the bf16 training path",
    "weight_quant_grouped_matmul": "quantised grouped matmul, not the bf16 training path",
    "npu_apply_fused_ema_adamw": "the EMA AdamW optimizer, which the recipe does not select",
    "npu_alltoall_allgather_bmm": "communication-fused batched matmul; needs HCCL",
    "npu_bmm_reducescatter_alltoall": "communication-fused batched matmul; needs HCCL",
    "npu_grouped_mat_mul_all_reduce": "communication-fused grouped matmul; needs HCCL",
    "npu_mm_all_reduce_add_rms_norm": "communication-fused matmul + RMSNorm; needs HCCL",
    "npu_mm_all_reduce_add_rms_norm_": "communication-fused matmul + RMSNorm; needs HCCL",
    "lcal": "MindSpeed's CoC communication library; needs HCCL",
    "npu_dropout_add_layer_norm": "not called on the DeepSeek-V3 path",
    "npu_ffn": "not called on the DeepSeek-V3 path",
    "adaptive_cp": "adaptive context parallelism only",
    "algorithm": "--reuse-fp32-param only (reuse_data_ptr), which MindSpeed refuses with the swap "
                 "optimizer the recipe uses",
    "smart_swap": "MindSpeed's smart swap memory feature, not enabled by the recipe",
    "AdaptiveRecomputing": "MindSpeed's adaptive recomputing feature, not enabled by the recipe",
}
"""MindSpeed op builder names the stand-in does not answer, with the reason."""
