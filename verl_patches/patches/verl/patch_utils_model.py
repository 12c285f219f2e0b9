"""The router's expert bias is loaded at full precision (fp32), by the actor and the reference alike.

Upstream: verl/utils/model.py:load_mcore_dist_weights loads a Megatron distributed checkpoint into the
model verl just built. megatron-core wraps the model in Float16Module, which casts every buffer to
bf16, the router's expert bias (DeepSeek-V3's e_score_correction_bias, fp32 in the released weights)
included; megatron-core turns it back to fp32 only at the router's first forward
(TopKRouter._maintain_float32_expert_bias). A checkpoint loaded before that is rounded to bf16: the
pretrained bias loses precision (routing differs from the model's), and a resumed run restores its
trained fp32 bias rounded (the resumed run then leaves the uninterrupted one's path at the next step).
We run megatron-core's own conversion on every router before the load, so the bias is loaded into
an fp32 tensor. verl's trainer checkpoint loads later, into the same fp32 tensor.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from verl_patches.core.fingerprint import Fingerprint
from verl_patches.core.record import Patch


def expert_bias_to_fp32(modules: Any) -> int:
    """megatron-core's own conversion of each router's expert bias to fp32; returns routers converted."""
    chunks = modules if isinstance(modules, (list, tuple)) else [modules]
    n = 0
    for chunk in chunks:
        for m in chunk.modules():
            if hasattr(m, "_maintain_float32_expert_bias"):
                m._maintain_float32_expert_bias()
                n += 1
    return n


def wrap_load_mcore_dist_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_mcore_dist_weights(parallel_model, dist_weight_path, is_value_model=False):
        expert_bias_to_fp32(parallel_model)
        return original(parallel_model, dist_weight_path, is_value_model)

    return load_mcore_dist_weights


PATCHES = [
    Patch(
        feature="checkpoint",
        id="verl.model.expert_bias_fp32_load",
        target="verl.utils.model:load_mcore_dist_weights",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=Fingerprint("def load_mcore_dist_weights(parallel_model, dist_weight_path, is_value_model=False)",
                                "e7fe4c2324c9e9a8"),
        replacement=f"{__name__}:wrap_load_mcore_dist_weights",
        flag="always on (models with megatron-core's router expert bias: DeepSeek-V3)",
        why="Float16Module leaves the router's expert bias in bf16 until its first forward, so a checkpoint loaded "
            "before that rounds the fp32 bias: the pretrained routing shifts and a resumed run diverges from the "
            "uninterrupted one.",
        remove_when="megatron-core keeps the expert bias in fp32 from construction (Float16Module skipping it), or "
                    "verl converts it before loading.",
    ),
]
