"""SwiGLU: ``torch_npu.npu_swiglu`` and its backward.
"""

from __future__ import annotations

import torch

from verl_patches.rigs.npu_rehearsal.ops.common import _f32, _fail, _tensor


def _swiglu_halves(op: str, name: str, x, dim: int):
    _tensor(op, name, x, floating=True)
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        _fail(op, f"dim must be an int in [{-x.dim()}, {x.dim()}), got {dim!r}")
    if x.shape[dim] % 2:
        _fail(op, f"{name}'s size along dim {dim} must be even, got {x.shape[dim]}")
    return _f32(x).chunk(2, dim=dim)


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:  # noqa: A002 (documented name)
    """``torch_npu.npu_swiglu(input, dim=-1) -> Tensor``.

    torch_npu docs: split ``input`` in two halves ``A, B`` along ``dim``; ``out = Swish(A) * B``
    with ``Swish(A) = A * sigmoid(A)``. Computed in fp32, returned in ``input``'s dtype.
    Differentiable by autograd (MindSpeed's fused SwiGLU calls it in the forward).
    """
    a, b = _swiglu_halves("npu_swiglu", "input", input, dim)
    return (torch.nn.functional.silu(a) * b).to(input.dtype)


def npu_swiglu_backward(grad_output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                        dim: int = -1) -> torch.Tensor:
    """``torch_npu.npu_swiglu_backward(grad_output, input, dim=-1) -> Tensor``: the gradient of
    ``npu_swiglu`` with respect to ``input`` (MindSpeed-LLM's fast MLP calls it positionally as
    ``npu_swiglu_backward(grad, swiglu_input, -1)``). Written out: with ``s = sigmoid(A)``,
    ``dA = g * B * s * (1 + A * (1 - s))`` and ``dB = g * A * s``, concatenated along ``dim``.
    """
    op = "npu_swiglu_backward"
    a, b = _swiglu_halves(op, "input", input, dim)
    _tensor(op, "grad_output", grad_output, floating=True)
    expected = list(input.shape)
    expected[dim] //= 2
    if list(grad_output.shape) != expected:
        _fail(op, f"grad_output's shape {tuple(grad_output.shape)} must be input's shape with dim "
                  f"{dim} halved: {tuple(expected)}")
    g = _f32(grad_output)
    s = torch.sigmoid(a)
    grad_a = g * b * s * (1 + a * (1 - s))
    grad_b = g * a * s
    return torch.cat((grad_a, grad_b), dim=dim).to(input.dtype)
