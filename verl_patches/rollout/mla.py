"""What vLLM's MLA attention derives from its weights (W_UK_T and W_UV from kv_b_proj): redone
after the weights change, and freed with the weights.

vLLM (MLACommonImpl) and vLLM-Ascend (AscendMLAImpl) compute them once in
process_weights_after_loading; a weight update makes them stale. At DeepSeek-V3 TP2 they are
about 1 GB per die (64 local heads x 512 x 128 x 2 tensors x 61 layers in bf16), resident for
nothing while the die trains: they leave with the rollout weights and come back with the reshard.
"""

from __future__ import annotations

from typing import Any

import torch

DERIVED = ("W_UK_T", "W_UV")


def _mla_layers(model: torch.nn.Module) -> list[Any]:
    from vllm.attention import Attention

    return [m for m in model.modules()
            if isinstance(m, Attention) and getattr(m, "use_mla", False) and hasattr(m, "process_weights_after_loading")]


def redo_mla_post_load(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Recompute the derived tensors from the current weights; returns the layers processed."""
    layers = _mla_layers(model)
    for layer in layers:
        layer.process_weights_after_loading(dtype)
    return len(layers)


def release_mla_derived(model: torch.nn.Module) -> int:
    """Free the derived tensors (replaced by empty ones: a generation before the next
    redo_mla_post_load fails on shapes instead of reading stale values); returns bytes freed."""
    freed = 0
    for layer in _mla_layers(model):
        for name in DERIVED:
            t = getattr(layer.impl, name, None)
            if isinstance(t, torch.Tensor) and t.numel():
                freed += t.numel() * t.element_size()
                setattr(layer.impl, name, t.new_empty(0))
    return freed
