"""What every operator module shares: torch_npu's constants, fp32 accumulation, and the input checks that
raise ``ValueError`` naming the argument and the rule.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


INT_MAX = 2147483647
"""torch_npu's default for ``pre_tockens`` / ``next_tockens``: no band limit."""

COMPRESSED_MASK_SIZE = 2048
"""Side of the compressed causal mask that sparse modes 2, 3 and 4 take (torch_npu docs)."""


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation (float64 stays float64, for gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(_acc_dtype(t.dtype))


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _tensor(op: str, name: str, value, *, dims: Optional[Sequence[int]] = None,
            floating: bool = False) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dims is not None and value.dim() not in dims:
        _fail(op, f"{name} must have {' or '.join(str(d) for d in dims)} dimensions, "
                  f"got shape {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        _fail(op, f"{name} must be a floating-point tensor, got {value.dtype}")
    return value


def _same_device(op: str, reference: torch.Tensor, **tensors) -> None:
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.device != reference.device:
            _fail(op, f"{name} is on {tensor.device}, the other inputs on {reference.device}")
