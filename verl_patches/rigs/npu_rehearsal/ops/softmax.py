"""Scaled masked softmax: ``torch_npu.npu_scaled_masked_softmax``.
"""

from __future__ import annotations

import torch

from verl_patches.rigs.npu_rehearsal.ops.common import _f32, _fail, _same_device, _tensor


SCALED_MASKED_SOFTMAX_FILL = -10000.0
"""What masked positions become before the softmax (the Megatron mask_func the op replaces)."""


def npu_scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor, scale: float = 1.0,
                              fixed_triu_mask: bool = False) -> torch.Tensor:
    """``torch_npu.npu_scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False) -> Tensor``.

    torch_npu docs: ``softmax((x * scale).masked_fill(mask, fill), dim=-1)`` where ``mask`` is True
    at positions to hide; with ``fixed_triu_mask`` the kernel uses the upper-triangular mask
    ``triu(ones, diagonal=1)`` instead of ``mask``. ``x`` is 4-D with its last two dims in
    [32, 4096] and divisible by 32; ``mask`` is 4-D bool with the same last two dims and broadcasts
    to ``x``. Reading chosen for ``fill``: -10000.0, the value of Megatron's ``attention_mask_func``
    that the performance guide says this op replaces (a fully hidden row is then uniform, not NaN).
    Computed in fp32, returned in ``x``'s dtype; differentiable by autograd.
    """
    op = "npu_scaled_masked_softmax"
    _tensor(op, "x", x, dims=(4,), floating=True)
    _tensor(op, "mask", mask, dims=(4,))
    _same_device(op, x, mask=mask)
    if mask.dtype != torch.bool:
        _fail(op, f"mask must be a bool tensor, got {mask.dtype}")
    for axis in (-2, -1):
        if not (32 <= x.shape[axis] <= 4096 and x.shape[axis] % 32 == 0):
            _fail(op, f"x's dim {x.dim() + axis} must be in [32, 4096] and divisible by 32, "
                      f"got {x.shape[axis]}")
    if mask.shape[-2:] != x.shape[-2:]:
        _fail(op, f"mask's last two dims {tuple(mask.shape[-2:])} must equal x's {tuple(x.shape[-2:])}")
    try:
        if torch.broadcast_shapes(mask.shape, x.shape) != x.shape:
            raise RuntimeError
    except RuntimeError:
        _fail(op, f"mask {tuple(mask.shape)} must broadcast to x {tuple(x.shape)}")
    if fixed_triu_mask:
        rows, cols = x.shape[-2:]
        mask = torch.ones(rows, cols, dtype=torch.bool, device=x.device).triu(1)
    scores = (_f32(x) * float(scale)).masked_fill(mask, SCALED_MASKED_SOFTMAX_FILL)
    return torch.softmax(scores, dim=-1).to(x.dtype)
