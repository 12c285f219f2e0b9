"""Packed sequences through MindSpeed-LLM's latent attention reach the NPU's rotary kernel in the shape it takes.

Upstream: megatron/core/models/common/embeddings/rope_utils.py:_apply_rotary_pos_emb_thd applies RoPE to packed
("thd") sequences. It takes ``t`` as [tokens, heads, dim], splits it by sequence and hands each piece, made
[s, 1, heads, dim], to ``_apply_rotary_pos_emb_bshd``, which MindSpeed-LLM points at torch_npu's
``npu_rotary_position_embedding`` (a 4-D input, as torch_npu documents it). verl packs every micro-batch (its
Megatron forward passes ``PackedSeqParams`` with qkv_format "thd") and keeps the batch dimension of one:
MindSpeed-LLM 2.2.0's MultiHeadLatentAttention hands its rotary parts over as [tokens, 1, heads, dim], so each
piece reaches the kernel 5-D (found by the NPU rehearsal's tiny run: the reference's first log-prob forward).
megatron-core's own latent attention squeezes that dimension first (its thd helper is written for that), and
only the NPU path builds MindSpeed-LLM's attention, so no CPU or GPU run met it.

We drop a batch dimension of one before the split and put it back after: the same RoPE (per position, on the
last dimension), with 4-D pieces for the kernel. Any other shape goes to upstream unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def wrap_apply_rotary_pos_emb_thd(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, *args, **kwargs):
        if t.dim() == 4 and t.shape[1] == 1:  # [tokens, 1, heads, dim]: a batch dimension of one
            return original(t.squeeze(1), cu_seqlens, freqs, *args, **kwargs).unsqueeze(1)
        return original(t, cu_seqlens, freqs, *args, **kwargs)

    return _apply_rotary_pos_emb_thd


PATCHES = [
    Patch(
        feature="model_layout",
        id="megatron.rope_thd_batch_of_one",
        target="megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_thd",
        kind="wrap",
        phases=("worker",),
        upstream="megatron_core",
        versions="==0.12.1",
        fingerprint=Fingerprint(
            signature="def _apply_rotary_pos_emb_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, "
                      "rotary_interleaved: bool=False, multi_latent_attention: bool=False, mscale: float=1.0) "
                      "-> Tensor",
            source_sha="cca4ad1dddf2ab73"),
        replacement=f"{__name__}:wrap_apply_rotary_pos_emb_thd",
        flag="always on (NPU: verl's packed sequences through MindSpeed-LLM's latent attention)",
        why="MindSpeed-LLM's latent attention hands packed sequences' rotary parts over with a batch dimension of "
            "one, which megatron's thd helper does not expect: each sequence reaches torch_npu's rotary kernel 5-D, "
            "where the kernel takes 4-D.",
        remove_when="MindSpeed-LLM's MultiHeadLatentAttention squeezes the batch dimension for packed sequences "
                    "(as megatron-core's does), or megatron's thd helper accepts [t, 1, h, d].",
        upstream_ref="megatron-core 0.12.1 rope_utils._apply_rotary_pos_emb_thd; MindSpeed-LLM 2.2.0 "
                     "mindspeed_llm/tasks/models/transformer/multi_latent_attention.py (mla_attention)",
        platforms=("npu",),
    ),
]
