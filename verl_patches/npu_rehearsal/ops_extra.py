"""Host implementations of torch_npu operators the NPU path needed before ``ops.py`` (the operator table of
the NPU rehearsal platform) had them; same tables, same rules: torch_npu's documented signature and
semantics, written in plain torch, each with its own reference test (tests/npu_rehearsal/test_ops_extra.py).
An operator moves to ``ops.py`` once it lands there (verl_patches.npu_rehearsal refuses a name in both).

- ``npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)``: RMSNorm over the trailing ``gamma.dim()`` dimensions:
  ``rstd = 1 / sqrt(mean(x**2) + epsilon)`` (float32, those dimensions kept as size 1), ``y = x * rstd * gamma``
  in x's dtype. verl 0.4.1 imports it (verl/models/transformers/npu_patch.py) whenever torch_npu imports.
- ``npu_rotary_mul(x, r1, r2, rotary_mode="half") -> x * r1 + rotate(x) * r2``: ``half`` rotates the two
  halves of the last dimension (``cat(-x2, x1)``), ``interleave`` the even/odd pairs (``(-x1, x0)``);
  r1, r2 (cos, sin) broadcast against x. verl imports it at module level in the same file.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    if mode == "interleave":
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    raise ValueError(f"npu_rotary_mul: rotary_mode {mode!r} is not one of 'half', 'interleave'")


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    return x * r1 + _rotate(x, rotary_mode) * r2


OPERATORS: dict[str, Callable[..., Any]] = {
    "npu_rms_norm": npu_rms_norm,
    "npu_rotary_mul": npu_rotary_mul,
}
MINDSPEED_KERNELS: dict[str, dict[str, Callable[..., Any]]] = {}
