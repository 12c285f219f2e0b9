"""verl's packed sequences attend within themselves, causally, in MindSpeed-LLM's core attention.

Upstream: mindspeed_llm/core/transformer/custom_dot_product_attention.py:CustomDotProductAttentionImpl.forward
(MindSpeed-LLM v2.2.0; the core attention of its DeepSeek spec's latent attention) calls torch_npu's
``npu_fusion_attention`` in the layout of ``--shape-order`` (the recipe's: SBH), with MindSpeed's global mask (the
compressed causal mask, ``sparse_mode`` 2) and the sequence boundaries of MindSpeed's own data pipeline
(``mindspeed.utils.get_actual_seq_len()``, set only under ``--reset-attention-mask``). verl packs every
micro-batch into one row (its Megatron forward: ``PackedSeqParams`` with qkv_format "thd"), which this method
ignores: the mask is causal over the whole row, so every sequence attended to the sequences packed before it.
Found by the NPU rehearsal's tiny run: the training model's log-probs were 15-30 times
further from the rollout's (an independent implementation on the same weights) than the CPU platform's, and
back to its distance with one sequence per micro-batch.

We run verl's packed micro-batches as MindSpeed-LLM runs its own packed data: the varlen layout (``TND``, in which
it chooses ``sparse_mode`` 4, a band of ``--pre-tockens`` / ``--next-tockens`` = 65536 / 0 within each sequence:
causal), the sequences' ends from verl's ``cu_seqlens_q`` as ``actual_seq_len``, and the compressed causal mask
that mode takes; MindSpeed-LLM's global arguments, MindSpeed's ``actual_seq_len`` and the module's cached mask are
restored afterwards.
Anything else (no packed parameters, another format, a batch of more than one row) goes to upstream unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch

COMPRESSED_MASK = 2048  # the side of the causal mask sparse modes 2-4 take (torch_npu's npu_fusion_attention)
_MASKS: dict[str, Any] = {}


def _causal_mask(device: Any) -> Any:
    import torch  # at call time: the doctor reads the catalogue in a Python that may have no torch

    key = str(device)
    if key not in _MASKS:
        _MASKS[key] = torch.triu(torch.ones(COMPRESSED_MASK, COMPRESSED_MASK, dtype=torch.bool), diagonal=1).to(device)
    return _MASKS[key]


def wrap_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q = query[0] if isinstance(query, (list, tuple)) else query
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd" or q.shape[1] != 1:
            return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        # Upstream modules, imported at call time: this one is imported with the catalogue, before MindSpeed loads.
        from megatron.training import get_args
        from mindspeed import utils as mindspeed_utils

        args = get_args()
        ends = [int(x) for x in packed_seq_params.cu_seqlens_q[1:].tolist()]
        if not ends or ends[-1] != q.shape[0]:
            raise ValueError(f"packed sequences end at {ends[-1:]} but the attention's input has {q.shape[0]} tokens: "
                             "verl's cu_seqlens_q do not describe this micro-batch")
        saved = (args.shape_order, args.sparse_mode, mindspeed_utils.get_actual_seq_len(),
                 getattr(self, "attention_mask", None))
        args.shape_order = "TND"
        mindspeed_utils.set_actual_seq_len(ends)
        self.attention_mask = None  # upstream keeps a cached mask whose side equals the token count
        try:
            return original(self, query, key, value, _causal_mask(q.device), attn_mask_type, attention_bias,
                            packed_seq_params)
        finally:
            args.shape_order, args.sparse_mode = saved[0], saved[1]
            mindspeed_utils.set_actual_seq_len(saved[2])
            self.attention_mask = saved[3]

    return forward


PATCHES = [
    Patch(
        feature="model_layout",
        id="mindspeed_llm.packed_sequences_attend_within",
        target="mindspeed_llm.core.transformer.custom_dot_product_attention:CustomDotProductAttentionImpl.forward",
        kind="wrap",
        phases=("worker",),
        upstream="mindspeed_llm",
        versions="==0.0.1",
        fingerprint=Fingerprint(
            signature="def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, "
                      "packed_seq_params=None)",
            source_sha="405132aa3bfa2b26"),
        replacement=f"{__name__}:wrap_forward",
        flag="always on (NPU: verl's packed micro-batches through MindSpeed-LLM's core attention)",
        why="MindSpeed-LLM's core attention ignores verl's packed-sequence parameters: with the recipe's SBH layout "
            "its causal mask spans the whole packed micro-batch, so each sequence attends to the sequences packed "
            "before it.",
        remove_when="MindSpeed-LLM's attention reads PackedSeqParams (varlen with cu_seqlens, causal per sequence), "
                    "or verl passes MindSpeed's actual_seq_len itself.",
        upstream_ref="MindSpeed-LLM v2.2.0 mindspeed_llm/core/transformer/custom_dot_product_attention.py",
        platforms=("npu",),
    ),
]
