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

Second record, the loaded state handed back: megatron-core's ``dist_checkpointing.load`` fills in place
the tensors a sharded state dict holds, but some entries are built for the load and only returned.
GroupedMLP's expert weights (the grouped-GEMM experts MindSpeed builds on an NPU: ``weight1`` /
``weight2``, stored per expert and transposed) are a ``ShardedTensorFactory``: the load reads each
expert's piece into new tensors, merges them and returns the merge. verl's loader drops what the load
returns, so those experts stayed as initialised. Ours does the same load, then copies every returned
tensor that is not already the model's own into it, and refuses a returned key the model lacks.
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


class CheckpointLoadError(RuntimeError):
    """The distributed checkpoint's load returned a tensor the model cannot take (names the key)."""


def hand_back(module: Any, loaded: Any) -> int:
    """Copy into ``module``'s parameters and buffers each tensor of ``loaded`` (the state dict
    ``dist_checkpointing.load`` returned) that is not already the module's own; returns how many were copied.
    Extra states (``*._extra_state``: Transformer Engine's metadata, never read by verl's loader) are left
    as they were."""
    import torch  # at call time: the doctor reads the catalogue in a Python that may have no torch

    own = module.state_dict(keep_vars=True)
    copied = 0
    for key, value in loaded.items():
        if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
            continue
        target = own.get(key)
        if target is None:
            raise CheckpointLoadError(f"the checkpoint's load returned {key!r}, which the model "
                                      f"({type(module).__name__}) does not have: the checkpoint was written for "
                                      f"another layer spec (tools hf_to_mcore --spec)")
        if target.data_ptr() == value.data_ptr() and target.shape == value.shape:
            continue  # loaded in place
        if target.shape != value.shape:
            raise CheckpointLoadError(f"the checkpoint's load returned {key!r} of shape {tuple(value.shape)}, the "
                                      f"model's is {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value)
        copied += 1
    return copied


def load_mcore_dist_weights(parallel_model, dist_weight_path, is_value_model=False):
    """Replaces verl/utils/model.py:load_mcore_dist_weights (verl 0.4.1): per model chunk, the same
    megatron-core load (its sharded state dict; a value model without its output layer; unexpected
    checkpoint keys allowed), then what the load returns handed back to the chunk (``hand_back``)."""
    # Upstream modules, imported at call time: the catalogue imports this module before megatron-core and verl load.
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import StrictHandling
    from verl.utils.megatron_utils import unwrap_model

    for model in parallel_model:
        module = unwrap_model(model)
        ssd = module.sharded_state_dict()
        if is_value_model:
            ssd = {k: v for k, v in ssd.items() if "output_layer" not in k}
        loaded = dist_checkpointing.load(ssd, dist_weight_path, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
        hand_back(module, loaded)


def wrap_load_mcore_dist_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_mcore_dist_weights(parallel_model, dist_weight_path, is_value_model=False):
        expert_bias_to_fp32(parallel_model)
        return original(parallel_model, dist_weight_path, is_value_model)

    return load_mcore_dist_weights


_FINGERPRINT = Fingerprint("def load_mcore_dist_weights(parallel_model, dist_weight_path, is_value_model=False)",
                           "e7fe4c2324c9e9a8")

PATCHES = [
    Patch(
        feature="checkpoint",
        id="verl.model.load_hands_back",
        target="verl.utils.model:load_mcore_dist_weights",
        kind="replace",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=_FINGERPRINT,
        replacement=f"{__name__}:load_mcore_dist_weights",
        flag="always on (models whose sharded state dict has factories: GroupedMLP's experts, MindSpeed's on NPU)",
        why="dist_checkpointing.load returns the tensors it built for ShardedTensorFactory entries (GroupedMLP's "
            "transposed expert weights) instead of filling the model's; verl drops the return, so those experts "
            "keep their initial values.",
        remove_when="verl's loader hands the returned state dict back to the model (load_state_dict), or "
                    "megatron-core loads factory entries in place.",
    ),
    Patch(
        feature="checkpoint",
        id="verl.model.expert_bias_fp32_load",
        target="verl.utils.model:load_mcore_dist_weights",
        kind="wrap",
        phases=("worker",),
        upstream="verl",
        versions="==0.4.1",
        fingerprint=_FINGERPRINT,
        replacement=f"{__name__}:wrap_load_mcore_dist_weights",
        after=("verl.model.load_hands_back",),
        flag="always on (models with megatron-core's router expert bias: DeepSeek-V3)",
        why="Float16Module leaves the router's expert bias in bf16 until its first forward, so a checkpoint loaded "
            "before that rounds the fp32 bias: the pretrained routing shifts and a resumed run diverges from the "
            "uninterrupted one.",
        remove_when="megatron-core keeps the expert bias in fp32 from construction (Float16Module skipping it), or "
                    "verl converts it before loading.",
    ),
]
