"""Rotary position embedding: ``torch_npu.npu_rotary_mul`` and ``npu_rotary_position_embedding`` (MindSpeed's
kernel of the same name too).
"""

from __future__ import annotations

import torch

from verl_patches.rigs.npu_rehearsal.ops.common import _f32, _fail, _same_device, _tensor


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rope(op: str, x, r1, r2, interleaved: bool, names=("x", "cos", "sin")) -> torch.Tensor:
    _tensor(op, names[0], x, dims=(4,), floating=True)
    _tensor(op, names[1], r1, dims=(4,), floating=True)
    _tensor(op, names[2], r2, dims=(4,), floating=True)
    _same_device(op, x, **{names[1]: r1, names[2]: r2})
    if x.shape[-1] % 2:
        _fail(op, f"the last dim of {names[0]} must be even, got {x.shape[-1]}")
    if r1.shape != r2.shape:
        _fail(op, f"{names[1]} {tuple(r1.shape)} and {names[2]} {tuple(r2.shape)} must have one shape")
    if r1.shape[-1] != x.shape[-1]:
        _fail(op, f"the last dim of {names[1]} ({r1.shape[-1]}) must equal {names[0]}'s "
                  f"({x.shape[-1]})")
    try:
        torch.broadcast_shapes(r1.shape, x.shape)
    except RuntimeError:
        _fail(op, f"{names[1]} {tuple(r1.shape)} must broadcast to {names[0]} {tuple(x.shape)}")
    x32 = _f32(x)
    out = x32 * _f32(r1) + _rotate(x32, interleaved) * _f32(r2)
    return out.to(x.dtype)


def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,  # noqa: A002
                   rotary_mode: str = "half") -> torch.Tensor:
    """``torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor``.

    torch_npu docs: ``out = x * r1 + rotate(x) * r2`` on 4-D ``x``; ``rotate`` for ``'half'``
    is ``cat(-x[..., D/2:], x[..., :D/2])``, for ``'interleave'`` it maps each pair
    ``(x0, x1) -> (-x1, x0)``; ``r1`` (cos) and ``r2`` (sin) broadcast to ``x``. MindSpeed-LLM
    calls ``npu_rotary_mul(t, cos, sin)`` in the forward; differentiable by autograd.
    """
    op = "npu_rotary_mul"
    if rotary_mode not in ("half", "interleave"):
        _fail(op, f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    return _rope(op, input, r1, r2, rotary_mode == "interleave", names=("input", "r1", "r2"))


def npu_rotary_position_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                  mode: int = 0) -> torch.Tensor:
    """``torch_npu.npu_rotary_position_embedding(x, cos, sin, mode=0) -> Tensor`` and MindSpeed's
    kernel of the same name (``RotaryPositionEmbeddingOpBuilder``, called as
    ``npu_rotary_position_embedding(x, cos, sin, mode)`` by ``mindspeed/ops``).

    torch_npu docs: ``mode`` 0 is the "rotate_half" form, 1 the "rotate_interleaved" form (MindSpeed
    passes ``1 if rotary_interleaved else 0``); ``out = x * cos + rotate(x) * sin`` on 4-D
    ``x``. Differentiable by autograd.
    """
    op = "npu_rotary_position_embedding"
    if mode not in (0, 1) or isinstance(mode, bool):
        _fail(op, f"mode must be 0 (rotate_half) or 1 (rotate_interleaved), got {mode!r}")
    return _rope(op, x, cos, sin, mode == 1)
