"""What vLLM's MLA attention derives from its weights (W_UK_T and W_UV from kv_b_proj): redone
after the weights change, and freed with the weights.

vLLM (MLACommonImpl) and vLLM-Ascend (AscendMLAImpl) compute them once in
process_weights_after_loading; a weight update makes them stale. At DeepSeek-V3 TP2 they are
about 1 GB per die (64 local heads x 512 x 128 x 2 tensors x 61 layers in bf16), resident for
nothing while the die trains: they leave with the rollout weights and come back with the reshard.
Where they are alive when redone (graph mode: they stay in the weights' address-stable region),
the new values are written into them in place, so captured graphs keep reading them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

DERIVED = ("W_UK_T", "W_UV")


class MLADerivedError(RuntimeError):
    """A recomputed derived tensor cannot be written into the one captured graphs read."""


def _mla_layers(model: torch.nn.Module) -> list[Any]:
    # Lazy: vLLM is needed only when a vLLM model is walked (the checks' arithmetic runs without it).
    from vllm.attention import Attention

    return [m for m in model.modules()
            if isinstance(m, Attention) and getattr(m, "use_mla", False) and hasattr(m, "process_weights_after_loading")]


def redo_mla_post_load(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Recompute the derived tensors from the current weights; returns the layers processed.

    One layer at a time, so at most one layer's new tensors exist beside the kept ones."""
    layers = _mla_layers(model)
    for layer in layers:
        rewrite_in_place(layer.impl, lambda layer=layer: layer.process_weights_after_loading(dtype))
    return len(layers)


def rewrite_in_place(impl: Any, recompute: Callable[[], None], names: tuple[str, ...] = DERIVED) -> int:
    """Run ``recompute`` (which rebinds ``impl``'s derived tensors), then put back every derived
    tensor that was alive before it, holding the new values: a view at the same memory (vLLM's
    CUDA MLA derives views of kv_b_proj's weight) is kept as it was, anything else is copied in
    (vLLM-Ascend derives contiguous copies). Released ones (no elements) take the new tensor.
    Returns the bytes copied."""
    old = {n: getattr(impl, n, None) for n in names}
    recompute()
    copied = 0
    for n, o in old.items():
        if not isinstance(o, torch.Tensor) or not o.numel():
            continue
        new = getattr(impl, n, None)
        if not isinstance(new, torch.Tensor) or new.shape != o.shape or new.dtype != o.dtype:
            got = None if not isinstance(new, torch.Tensor) else (tuple(new.shape), new.dtype)
            raise MLADerivedError(f"{type(impl).__name__}.{n}: recomputed as {got}, but the tensor graphs read is "
                                  f"{(tuple(o.shape), o.dtype)}; it cannot be rewritten in place")
        if not (new.data_ptr() == o.data_ptr() and new.stride() == o.stride()):
            o.copy_(new)
            copied += o.numel() * o.element_size()
        setattr(impl, n, o)
    return copied


def derived_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The live derived tensors by qualified name (``<attention module>.impl.W_UK_T``)."""
    # Lazy: vLLM is needed only when a vLLM model is walked (the checks' arithmetic runs without it).
    from vllm.attention import Attention

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Attention) and getattr(m, "use_mla", False) and hasattr(m, "impl"):
            for attr in DERIVED:
                t = getattr(m.impl, attr, None)
                if isinstance(t, torch.Tensor) and t.numel():
                    out[f"{name}.impl.{attr}"] = t
    return out


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


def check_mla_derived(model: torch.nn.Module, index: int) -> int:
    """Re-derive W_UK_T and W_UV of one MLA layer (``index`` modulo the layer count) from its current
    kv_b_proj weight, with the definition both vLLM (MLACommonImpl) and vLLM-Ascend (AscendMLAImpl)
    use, and compare them bit for bit with the tensors the attention reads. MLADerivedError names the
    layer when they differ (stale after a weight update: the NeMo-RL / vLLM-Ascend failure class).
    Returns the layers checked (0: no MLA layer, or a quantized kv_b_proj that has no plain weight)."""
    # Lazy: vLLM is needed only when a vLLM model is walked (the checks' arithmetic runs without it).
    from vllm.attention import Attention

    layers = [(n, m) for n, m in model.named_modules()
              if isinstance(m, Attention) and getattr(m, "use_mla", False) and hasattr(m, "impl")]
    if not layers:
        return 0
    name, layer = layers[index % len(layers)]
    impl = layer.impl
    weight = getattr(getattr(impl, "kv_b_proj", None), "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return 0
    L, N, P, V = impl.kv_lora_rank, impl.num_heads, impl.qk_nope_head_dim, impl.v_head_dim
    w_uk, w_uv = weight.T.reshape(L, N, P + V).split([P, V], dim=-1)
    want = {"W_UV": w_uv.transpose(0, 1), "W_UK_T": w_uk.permute(1, 2, 0)}
    for attr, expected in want.items():
        have = getattr(impl, attr, None)
        if not isinstance(have, torch.Tensor) or tuple(have.shape) != tuple(expected.shape) or \
                not torch.equal(have, expected.to(have.dtype)):
            got = None if not isinstance(have, torch.Tensor) else tuple(have.shape)
            raise MLADerivedError(f"{name}.impl.{attr} (shape {got}) is not what kv_b_proj's current weight derives "
                                  f"(shape {tuple(expected.shape)}): the attention reads stale MLA tensors. The "
                                  "reshard must be followed by redo_mla_post_load (patch verl.sharding_manager.reshard)")
    return 1
