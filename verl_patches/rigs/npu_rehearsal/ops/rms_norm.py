"""RMSNorm: ``torch_npu.npu_rms_norm``.
"""

from __future__ import annotations

import math

import torch

from verl_patches.rigs.npu_rehearsal.ops.common import _f32, _fail, _same_device, _tensor


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    """``torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (Tensor y, Tensor rstd)``.

    torch_npu docs: ``rstd = 1 / sqrt(mean(x^2 over gamma's dims) + epsilon)``, ``y = x * rstd *
    gamma``; ``gamma`` matches the trailing dims of ``self``; ``rstd`` is float32 with those dims
    kept as size 1; ``y`` has ``self``'s dtype. Computed in fp32 (the kernel reduces in fp32).
    Differentiable by autograd, as the registered op is (MindSpeed's and MindSpeed-LLM's RMSNorm
    modules call ``npu_rms_norm(x, weight, epsilon=eps)[0]`` in their forward).
    """
    op = "npu_rms_norm"
    _tensor(op, "self", self, floating=True)
    _tensor(op, "gamma", gamma, floating=True)
    _same_device(op, self, gamma=gamma)
    if gamma.dim() < 1 or gamma.dim() > self.dim() \
            or tuple(self.shape[self.dim() - gamma.dim():]) != tuple(gamma.shape):
        _fail(op, f"gamma's shape {tuple(gamma.shape)} must equal the trailing dims of self's "
                  f"shape {tuple(self.shape)}")
    if not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon) or epsilon < 0:
        _fail(op, f"epsilon must be a finite float >= 0, got {epsilon!r}")
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    x32 = _f32(self)
    rstd = torch.rsqrt(x32.square().mean(dim=dims, keepdim=True) + float(epsilon))
    y = (x32 * rstd * _f32(gamma)).to(self.dtype)
    return y, rstd
