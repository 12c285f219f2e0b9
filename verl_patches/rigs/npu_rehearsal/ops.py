"""Host implementations of the torch_npu operators and MindSpeed kernels the DeepSeek-V3 training
path calls: a declared stand-in of the NPU's kernels for the NPU rehearsal platform, used only when
that platform is selected (the stand-in ``torch_npu`` package looks operators up in ``OPERATORS``;
MindSpeed's op builders are answered from ``MINDSPEED_KERNELS``), never where the real torch_npu
imports.

What it proves: the math of each operator as torch_npu / CANN document it (layouts, scale, masks,
sparse modes, return tuples, the backward where the path calls it), each checked on its own against
an independent plain-torch reference in ``tests/npu_rehearsal/test_ops.py``. What it does not prove:
the NPU's kernels, the precision of their own accumulation and rounding (here: plain torch in fp32,
cast back to the input dtype, where the NPU kernels accumulate in fp32), their speed or memory, and
the NPU's dropout random stream.

Call forms follow the callers in MindSpeed 2.2.0 (``mindspeed/ops/*.py``, ``mindspeed/te/pytorch``,
``mindspeed/core``) and MindSpeed-LLM 2.2.0. Every operator validates its input and raises
``ValueError`` naming the argument and the rule; what the stand-in does not implement (a layout,
sparse mode or option the path does not use) is rejected the same way, never silently accepted.

What MindSpeed / MindSpeed-LLM call that is not implemented is absent from the two tables (so the
stand-in package fails naming it) and listed with its reason in ``NOT_IMPLEMENTED`` (torch_npu
operators: the HCCL-fused matmuls, inference attention, ``npu_fusion_attention_v2``, ...) and
``MINDSPEED_KERNELS_NOT_IMPLEMENTED`` (MindSpeed op builders).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

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


# --------------------------------------------------------------------------- RMSNorm

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


# --------------------------------------------------------------------------- rotary embedding

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


# --------------------------------------------------------------------------- SwiGLU

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


# --------------------------------------------------------------------------- scaled masked softmax

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


# --------------------------------------------------------------------------- fused attention

LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def _to_bnsd(op: str, name: str, t: torch.Tensor, layout: str, heads: Optional[int]):
    """Returns ``t`` as [B, N, S, D] (TND: [1, N, T, D]) and its head count."""
    dims = 3 if layout in ("BSH", "SBH", "TND") else 4
    _tensor(op, name, t, dims=(dims,), floating=True)
    if layout == "BSND":
        return t.permute(0, 2, 1, 3), t.shape[2]
    if layout == "BNSD":
        return t, t.shape[1]
    if layout == "TND":
        return t.permute(1, 0, 2).unsqueeze(0), t.shape[1]
    b_s = (t.shape[0], t.shape[1]) if layout == "BSH" else (t.shape[1], t.shape[0])
    if heads is None or heads <= 0 or t.shape[2] % heads:
        _fail(op, f"{name}'s hidden size {t.shape[2]} is not divisible into {heads} heads")
    seq_first = t if layout == "BSH" else t.transpose(0, 1)
    return seq_first.reshape(b_s[0], b_s[1], heads, t.shape[2] // heads).permute(0, 2, 1, 3), heads


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    if layout == "TND":
        return t.squeeze(0).permute(1, 0, 2)
    b, n, s, d = t.shape
    bsh = t.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return bsh if layout == "BSH" else bsh.transpose(0, 1)


def _cumulative(op: str, name: str, value, total: int) -> list:
    if value is None:
        _fail(op, f"{name} is required with input_layout 'TND'")
    values = value.tolist() if isinstance(value, torch.Tensor) else list(value)
    if not values or any(not isinstance(v, int) for v in values):
        _fail(op, f"{name} must be a non-empty sequence of ints (cumulative lengths), got {value!r}")
    if values[0] < 0 or any(b < a for a, b in zip(values, values[1:])):
        _fail(op, f"{name} must be non-decreasing cumulative lengths starting >= 0, got {values}")
    if values[-1] != total:
        _fail(op, f"{name} must end at the token count {total}, got {values[-1]}")
    return values


_COMPRESSED_MASKS: dict = {}


def _compressed_mask(device) -> torch.Tensor:
    if device not in _COMPRESSED_MASKS:
        _COMPRESSED_MASKS[device] = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE,
                                               dtype=torch.bool, device=device).triu(1)
    return _COMPRESSED_MASKS[device]


def _visible(op: str, sparse_mode: int, atten_mask, pre_tockens: int, next_tockens: int,
             shape, batch_heads, device, varlen=None):
    """The boolean [B|1, N|1, S1, S2] matrix of (query, key) pairs attention may use."""
    s1, s2 = shape
    rows = torch.arange(s1, device=device).unsqueeze(1)
    cols = torch.arange(s2, device=device).unsqueeze(0)
    if sparse_mode in (2, 3, 4):
        if not isinstance(atten_mask, torch.Tensor) \
                or tuple(atten_mask.shape) != (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE):
            _fail(op, f"sparse_mode {sparse_mode} needs the compressed atten_mask of shape "
                      f"({COMPRESSED_MASK_SIZE}, {COMPRESSED_MASK_SIZE}), got "
                      f"{None if atten_mask is None else tuple(atten_mask.shape)}")
        if not torch.equal(atten_mask.bool().to(device), _compressed_mask(device)):
            _fail(op, f"sparse_mode {sparse_mode}: atten_mask must be the compressed causal mask "
                      f"triu(ones({COMPRESSED_MASK_SIZE}, {COMPRESSED_MASK_SIZE}), diagonal=1)")
    if varlen is None:
        blocks = [(0, s1, 0, s2)]
    else:
        qs, ks = varlen
        blocks = list(zip([0] + qs[:-1], qs, [0] + ks[:-1], ks))
    visible = torch.zeros(s1, s2, dtype=torch.bool, device=device)
    for q0, q1, k0, k1 in blocks:
        r, c = rows[q0:q1] - q0, cols[:, k0:k1] - k0
        lq, lk = q1 - q0, k1 - k0
        if sparse_mode == 0 or sparse_mode == 1:
            block = torch.ones(lq, lk, dtype=torch.bool, device=device)
            if sparse_mode == 0 and atten_mask is not None:
                block = (c - r >= -pre_tockens) & (c - r <= next_tockens)
        elif sparse_mode == 2:
            block = c <= r
        elif sparse_mode == 3:
            block = c <= r + (lk - lq)
        else:
            shift = c - r - (lk - lq)
            block = (shift >= -pre_tockens) & (shift <= next_tockens)
        visible[q0:q1, k0:k1] = block
    visible = visible.view(1, 1, s1, s2)
    if sparse_mode in (0, 1) and atten_mask is not None:
        if not isinstance(atten_mask, torch.Tensor):
            _fail(op, f"atten_mask must be a torch.Tensor or None, got {type(atten_mask).__name__}")
        if atten_mask.dtype not in (torch.bool, torch.uint8):
            _fail(op, f"atten_mask must be bool or uint8 (True/1 = masked out), got {atten_mask.dtype}")
        b, n = batch_heads
        allowed = [(s1, s2), (1, 1, s1, s2), (b, 1, s1, s2), (b, n, s1, s2)]
        if tuple(atten_mask.shape) not in allowed:
            _fail(op, f"atten_mask's shape {tuple(atten_mask.shape)} must be one of {allowed} "
                      f"for sparse_mode {sparse_mode}")
        mask = atten_mask.bool().to(device)
        visible = visible & ~(mask if mask.dim() == 4 else mask.view(1, 1, s1, s2))
    elif sparse_mode == 1:
        _fail(op, "sparse_mode 1 (allMask) needs the full atten_mask")
    return visible


def _dropout_keep(seed: int, offset: int, shape, keep_prob: float, device) -> torch.Tensor:
    generator = torch.Generator(device="cpu")
    generator.manual_seed((int(seed) + int(offset)) % (2 ** 63))
    return (torch.rand(shape, generator=generator) < keep_prob).to(device)


def _attention_args(op, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask,
                    keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen,
                    actual_seq_kvlen, sparse_mode):
    if input_layout not in LAYOUTS:
        _fail(op, f"input_layout must be one of {LAYOUTS}, got {input_layout!r}")
    if not isinstance(head_num, int) or head_num <= 0:
        _fail(op, f"head_num must be a positive int, got {head_num!r}")
    if pse is not None:
        _fail(op, "pse (position-shift bias, ALiBi) is not implemented by the rehearsal stand-in; "
                  "the DeepSeek-V3 path passes pse=None")
    if padding_mask is not None:
        _fail(op, "padding_mask is reserved by torch_npu and must be None")
    if prefix is not None:
        _fail(op, "prefix (sparse_mode 5/6) is not implemented by the rehearsal stand-in")
    if sparse_mode not in (0, 1, 2, 3, 4) or isinstance(sparse_mode, bool):
        _fail(op, f"sparse_mode must be 0..4 on the rehearsal stand-in (5..8 are prefix/varlen "
                  f"variants it does not implement), got {sparse_mode!r}")
    if inner_precise not in (0, 1, 2, 3, 4):
        _fail(op, f"inner_precise must be 0..4, got {inner_precise!r}")
    if not isinstance(keep_prob, (int, float)) or not 0 < keep_prob <= 1:
        _fail(op, f"keep_prob must be in (0, 1], got {keep_prob!r}")
    for name, v in (("pre_tockens", pre_tockens), ("next_tockens", next_tockens)):
        if not isinstance(v, int) or isinstance(v, bool):
            _fail(op, f"{name} must be an int, got {v!r}")
    if sparse_mode == 4 and pre_tockens + next_tockens < 0:
        _fail(op, f"sparse_mode 4 needs pre_tockens + next_tockens >= 0, got {pre_tockens} + "
                  f"{next_tockens}")
    q, n1 = _to_bnsd(op, "query", query, input_layout, head_num)
    if input_layout not in ("BSH", "SBH") and n1 != head_num:
        _fail(op, f"head_num {head_num} must equal query's head dim {n1} in layout {input_layout}")
    d = q.shape[-1]
    n2 = None
    if input_layout in ("BSH", "SBH"):
        _tensor(op, "key", key, dims=(3,), floating=True)
        if key.shape[2] % d:
            _fail(op, f"key's hidden size {key.shape[2]} is not a multiple of the head dim {d}")
        n2 = key.shape[2] // d
    k, n2 = _to_bnsd(op, "key", key, input_layout, n2)
    v, n2v = _to_bnsd(op, "value", value, input_layout, n2)
    _same_device(op, query, key=key, value=value, atten_mask=atten_mask)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        _fail(op, f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, "
                  f"{value.dtype}")
    if k.shape[-1] != d:
        _fail(op, f"key's head dim {k.shape[-1]} must equal query's {d}")
    if n2v != n2 or n1 % n2:
        _fail(op, f"query's {n1} heads must be a multiple of key's {n2}, and value must have key's "
                  f"heads (got {n2v})")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        _fail(op, f"query, key and value must share the batch size, got {q.shape[0]}, {k.shape[0]}, "
                  f"{v.shape[0]}")
    if v.shape[2] != k.shape[2]:
        _fail(op, f"key and value must share the sequence length, got {k.shape[2]} and {v.shape[2]}")
    varlen = None
    if input_layout == "TND":
        varlen = (_cumulative(op, "actual_seq_qlen", actual_seq_qlen, q.shape[2]),
                  _cumulative(op, "actual_seq_kvlen", actual_seq_kvlen, k.shape[2]))
        if len(varlen[0]) != len(varlen[1]):
            _fail(op, f"actual_seq_qlen and actual_seq_kvlen must have one length, got "
                      f"{len(varlen[0])} and {len(varlen[1])}")
        if atten_mask is not None and sparse_mode in (0, 1):
            _fail(op, "a full atten_mask with input_layout 'TND' is not implemented by the "
                      "rehearsal stand-in; use sparse_mode 2, 3 or 4 with the compressed mask")
    elif actual_seq_qlen is not None or actual_seq_kvlen is not None:
        _fail(op, f"actual_seq_qlen / actual_seq_kvlen apply to input_layout 'TND' only, got "
                  f"{input_layout!r}")
    visible = _visible(op, sparse_mode, atten_mask, pre_tockens, next_tockens,
                       (q.shape[2], k.shape[2]), (q.shape[0], n1), query.device, varlen)
    group = n1 // n2
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return q, k, v, visible, group


def _softmax_stats_shape(layout: str, b: int, n: int, s: int):
    return (s, n, 8) if layout == "TND" else (b, n, s, 8)


def _stats_to_bnsd(stat: torch.Tensor, layout: str) -> torch.Tensor:
    # [B, N, S, 8] or [T, N, 8] -> [B, N, S, 1] (TND: [1, N, T, 1]); the 8 copies are equal.
    if layout == "TND":
        return stat[..., :1].permute(1, 0, 2).unsqueeze(0)
    return stat[..., :1]


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX,
                         next_tockens=INT_MAX, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
    """``torch_npu.npu_fusion_attention(...) -> (attention_out, softmax_max, softmax_sum,
    softmax_out, seed, offset, numels)``.

    torch_npu docs: ``attention_out = Dropout(Softmax(Mask(scale * Q K^T))) V`` per head.
    Layouts: BSH / SBH (H = N * D, ``head_num`` = N of query; key/value heads N2 = H_kv / D, N must
    be a multiple of N2: GQA), BSND, BNSD, and TND with ``actual_seq_qlen`` / ``actual_seq_kvlen``
    the cumulative sequence ends (each sequence attends within itself). Value may have its own head
    dim (MLA). ``atten_mask`` True / 1 means masked out. ``sparse_mode``: 0 default (no mask: all
    visible and pre/next ignored; with a full mask, also the band ``-pre_tockens <= j - i <=
    next_tockens``), 1 all-mask (full mask, band ignored), 2 left-up causal (``j <= i``), 3
    right-down causal (``j <= i + S2 - S1``), 4 band anchored right-down (``-pre_tockens <= j - i
    - (S2 - S1) <= next_tockens``); modes 2..4 take the compressed 2048x2048 mask
    ``triu(ones, 1)`` (checked) and apply per sequence in TND.

    Returned stats (docs): ``softmax_max`` and ``softmax_sum`` are float32 [B, N, S1, 8] ([T1, N,
    8] in TND), the row max of the scaled masked scores and the row sum of ``exp(score - max)``,
    repeated 8 times; ``softmax_out`` is reserved (an empty tensor); ``seed``, ``offset``,
    ``numels`` are the dropout stream's (ints). The training path uses ``[0]`` with autograd
    (MindSpeed / MindSpeed-LLM attention) and ``[0..2]`` plus ``npu_fusion_attention_grad`` in
    ring context parallelism.

    Readings chosen: a row with no visible key gives output 0, ``softmax_max`` -inf and
    ``softmax_sum`` 0 (its gradient is 0); dropout (``keep_prob < 1``) draws its keep-mask from a
    host generator seeded with ``seed + offset`` (``seed`` drawn from torch's default generator),
    so ``npu_fusion_attention_grad`` with the returned ``seed``/``offset`` regenerates the same mask:
    the NPU's random stream is not reproduced. ``inner_precise``, ``gen_mask_parallel`` and
    ``sync`` are performance hints with no effect here. Computed in fp32, returned in the input
    dtype; differentiable by autograd through ``attention_out``.
    """
    op = "npu_fusion_attention"
    q, k, v, visible, _ = _attention_args(
        op, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob,
        pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
        sparse_mode)
    if not isinstance(scale, (int, float)):
        _fail(op, f"scale must be a float, got {scale!r}")
    scores = torch.matmul(_f32(q), _f32(k).transpose(-1, -2)) * float(scale)
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    any_visible = visible.any(dim=-1, keepdim=True).expand_as(row_max)
    # The shift cancels in the softmax, so it is held constant for autograd.
    safe_max = torch.where(any_visible, row_max, torch.zeros_like(row_max)).detach()
    weights = torch.exp(scores - safe_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(any_visible, row_sum, torch.ones_like(row_sum))
    seed, offset, numels = 0, 0, 0
    if keep_prob < 1:
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,)).item())
        numels = probs.numel()
        probs = probs * _dropout_keep(seed, offset, probs.shape, keep_prob, probs.device) / keep_prob
    out = torch.matmul(probs, _f32(v)).to(query.dtype)
    b, n, s1 = q.shape[0], q.shape[1], q.shape[2]
    stats_shape = _softmax_stats_shape(input_layout, b, n, s1)
    softmax_max = _stats_from_bnsd(row_max.detach(), input_layout, stats_shape)
    softmax_sum = _stats_from_bnsd(row_sum.detach(), input_layout, stats_shape)
    softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
    return (_from_bnsd(out, input_layout), softmax_max, softmax_sum, softmax_out, seed, offset,
            numels)


def _stats_from_bnsd(stat: torch.Tensor, layout: str, shape) -> torch.Tensor:
    if layout == "TND":
        stat = stat.squeeze(0).permute(1, 0, 2)
    return _f32(stat).expand(*shape).contiguous()


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None,
                              padding_mask=None, atten_mask=None, softmax_max=None,
                              softmax_sum=None, softmax_in=None, attention_in=None,
                              scale_value=1.0, keep_prob=1.0, pre_tockens=INT_MAX,
                              next_tockens=INT_MAX, inner_precise=0, seed=0, offset=0, numels=0,
                              prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                              sparse_mode=0, gen_mask_parallel=True, sync=False):
    """``torch_npu.npu_fusion_attention_grad(...) -> (dq, dk, dv, dpse)``.

    torch_npu docs: the backward of ``npu_fusion_attention`` from the forward's saved
    ``softmax_max`` / ``softmax_sum`` (the probabilities are recomputed as ``exp(scale * Q K^T -
    max) / sum`` under the same mask, not from ``softmax_in``) and its output ``attention_in``.
    Written out (not via autograd): ``dV = P'^T dy`` with ``P'`` the dropped probabilities,
    ``dP = dy V^T`` (dropout mask applied), ``dS = P * (dP - rowsum(dy * attention_in))``,
    ``dQ = scale * dS K``, ``dK = scale * dS^T Q``; for GQA the key/value gradients sum over the
    query heads that share them. ``dq``/``dk``/``dv`` come in the inputs' layouts and dtype;
    ``dpse`` is an empty tensor (``pse`` is not implemented). ``softmax_max``, ``softmax_sum`` and
    ``attention_in`` are required (MindSpeed's ring attention passes them).
    """
    op = "npu_fusion_attention_grad"
    q, k, v, visible, group = _attention_args(
        op, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob,
        pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
        sparse_mode)
    if softmax_in is not None and softmax_in.numel():
        _fail(op, "softmax_in is reserved by torch_npu; pass None or the empty softmax_out")
    b, n, s1 = q.shape[0], q.shape[1], q.shape[2]
    stats_shape = _softmax_stats_shape(input_layout, b, n, s1)
    for name, stat in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        _tensor(op, name, stat)
        if tuple(stat.shape) != stats_shape:
            _fail(op, f"{name} must have shape {stats_shape} (the forward's), got "
                      f"{tuple(stat.shape)}")
    do, _ = _to_bnsd(op, "dy", dy, input_layout, head_num)
    o, _ = _to_bnsd(op, "attention_in", attention_in, input_layout, head_num)
    if do.shape != (b, n, s1, v.shape[-1]) or o.shape != do.shape:
        _fail(op, f"dy and attention_in must have the forward output's shape, got "
                  f"{tuple(dy.shape)} and {tuple(attention_in.shape)}")
    row_max = _stats_to_bnsd(_f32(softmax_max), input_layout)
    row_sum = _stats_to_bnsd(_f32(softmax_sum), input_layout)
    scores = torch.matmul(_f32(q), _f32(k).transpose(-1, -2)) * float(scale_value)
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    safe_sum = torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    probs = torch.exp(scores - safe_max).masked_fill(~visible, 0.0) / safe_sum
    do32 = _f32(do)
    dprobs = torch.matmul(do32, _f32(v).transpose(-1, -2))
    dropped = probs
    if keep_prob < 1:
        keep = _dropout_keep(seed, offset, probs.shape, keep_prob, probs.device) / keep_prob
        dropped = probs * keep
        dprobs = dprobs * keep
    dv = torch.matmul(dropped.transpose(-1, -2), do32)
    delta = (do32 * _f32(o)).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta)
    dq = torch.matmul(dscores, _f32(k)) * float(scale_value)
    dk = torch.matmul(dscores.transpose(-1, -2), _f32(q)) * float(scale_value)
    if group > 1:
        dk = dk.unflatten(1, (-1, group)).sum(dim=2)
        dv = dv.unflatten(1, (-1, group)).sum(dim=2)
    dpse = torch.empty(0, dtype=query.dtype, device=query.device)
    return (_from_bnsd(dq, input_layout).to(query.dtype), _from_bnsd(dk, input_layout).to(key.dtype),
            _from_bnsd(dv, input_layout).to(value.dtype), dpse)


# --------------------------------------------------------------------------- grouped matmul

def _group_sizes(op: str, group_list, group_list_type: int, groups: int, total: int) -> list:
    if group_list_type not in (0, 1):
        _fail(op, f"group_list_type must be 0 (cumulative ends) or 1 (per-group counts), got "
                  f"{group_list_type!r}")
    if isinstance(group_list, torch.Tensor):
        if group_list.dim() != 1 or group_list.dtype != torch.int64:
            _fail(op, f"group_list must be a 1-D int64 tensor or a list of ints, got "
                      f"{group_list.dtype} of shape {tuple(group_list.shape)}")
        values = group_list.tolist()
    elif isinstance(group_list, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in group_list):
        values = list(group_list)
    else:
        _fail(op, f"group_list must be a 1-D int64 tensor or a list of ints, got {group_list!r}")
    if len(values) != groups:
        _fail(op, f"group_list has {len(values)} entries for {groups} weight groups")
    if group_list_type == 0:
        if any(v < 0 for v in values) or any(b < a for a, b in zip(values, values[1:])):
            _fail(op, f"group_list (group_list_type 0) must be non-decreasing cumulative ends, "
                      f"got {values}")
        sizes = [b - a for a, b in zip([0] + values[:-1], values)]
    else:
        if any(v < 0 for v in values):
            _fail(op, f"group_list (group_list_type 1) must hold counts >= 0, got {values}")
        sizes = values
    if sum(sizes) > total:
        _fail(op, f"group_list covers {sum(sizes)} rows, more than the {total} the grouped axis has")
    return sizes


def _weights(op: str, weight) -> list:
    if isinstance(weight, torch.Tensor):
        _tensor(op, "weight", weight, dims=(3,), floating=True)
        return list(weight.unbind(0))
    if not isinstance(weight, (list, tuple)) or not weight:
        _fail(op, f"weight must be a non-empty list of 2-D tensors or a 3-D tensor, got "
                  f"{type(weight).__name__}")
    if len(weight) == 1 and isinstance(weight[0], torch.Tensor) and weight[0].dim() == 3:
        return list(weight[0].unbind(0))
    return [_tensor(op, f"weight[{i}]", w, dims=(2,), floating=True) for i, w in enumerate(weight)]


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(_f32(a), _f32(b))


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=-1,
                       group_list_type=0, act_type=0, output_dtype=None):
    """``torch_npu.npu_grouped_matmul(x, weight, *, ..., group_list=None, split_item=0,
    group_type=-1, group_list_type=0, act_type=0, output_dtype=None) -> List[Tensor]``,
    the non-quantised scenario (every quantisation / activation argument must be None / 0).

    torch_npu docs: ``y_i = x_i @ weight_i (+ bias_i)`` per group. ``group_type`` -1 (or None): no
    grouped axis, x, weight (and bias) lists of one length; 0: groups split the M axis of the single
    ``x`` [M, K] (``group_list`` rows per weight [K, N]); 2: groups split the K axis: with
    ``x = [A]`` [M, K] and ``weight = [B]`` [K, N], group g gives ``A[:, k_g] @ B[k_g, :]``
    (MindSpeed's TE grouped linear takes the weight gradient this way: ``[inp.T], [grad_output]``,
    ``split_item=3, group_type=2``). ``group_list`` is a list of ints or a 1-D int64 tensor, read as
    cumulative ends (``group_list_type`` 0) or counts (1). ``split_item`` 0/1: one output per group;
    2/3: one output (group_type 0: rows concatenated [M, N]; group_type 2: stacked [G, M, N]).
    ``weight`` may be one 3-D tensor [G, K, N]. Reading chosen: with group_type 0, rows of ``x``
    past the last group are left out of every group and come back as 0 in the single output.
    Accumulates in fp32, returns ``x``'s dtype.
    """
    op = "npu_grouped_matmul"
    for name, v in (("scale", scale), ("offset", offset), ("antiquant_scale", antiquant_scale),
                    ("antiquant_offset", antiquant_offset), ("per_token_scale", per_token_scale),
                    ("activation_input", activation_input),
                    ("activation_quant_scale", activation_quant_scale),
                    ("activation_quant_offset", activation_quant_offset),
                    ("output_dtype", output_dtype)):
        if v is not None and not (isinstance(v, (list, tuple)) and not v):
            _fail(op, f"{name} belongs to the quantised scenarios, which the rehearsal stand-in "
                      f"does not implement; pass None")
    if act_type != 0:
        _fail(op, f"act_type {act_type!r}: fused activations are not implemented; pass 0")
    if split_item not in (0, 1, 2, 3):
        _fail(op, f"split_item must be 0, 1, 2 or 3, got {split_item!r}")
    if group_type is None:
        group_type = -1
    if group_type not in (-1, 0, 2):
        _fail(op, f"group_type must be -1 (none), 0 (M axis) or 2 (K axis), got {group_type!r}")
    if not isinstance(x, (list, tuple)) or not x:
        _fail(op, f"x must be a non-empty list of tensors, got {type(x).__name__}")
    xs = [_tensor(op, f"x[{i}]", t, floating=True) for i, t in enumerate(x)]
    ws = _weights(op, weight)
    biases = [] if bias is None else list(bias)
    if biases and len(biases) != len(ws):
        _fail(op, f"bias has {len(biases)} tensors for {len(ws)} weights")
    _same_device(op, xs[0], **{f"x[{i}]": t for i, t in enumerate(xs)},
                 **{f"weight[{i}]": w for i, w in enumerate(ws)},
                 **{f"bias[{i}]": b for i, b in enumerate(biases)})
    dtype = xs[0].dtype

    def with_bias(y, i):
        return y + _f32(biases[i]) if biases else y

    if group_type == -1:
        if group_list is not None:
            _fail(op, "group_list needs group_type 0 or 2")
        if len(xs) != len(ws):
            _fail(op, f"group_type -1 needs one x per weight, got {len(xs)} and {len(ws)}")
        outs = []
        for i, (a, w) in enumerate(zip(xs, ws)):
            if a.shape[-1] != w.shape[0]:
                _fail(op, f"x[{i}] {tuple(a.shape)} and weight[{i}] {tuple(w.shape)} do not chain")
            outs.append(with_bias(_mm32(a, w), i).to(dtype))
        if split_item in (2, 3):
            return [torch.cat([o.reshape(-1, o.shape[-1]) for o in outs], dim=0)]
        return outs
    if len(xs) != 1:
        _fail(op, f"group_type {group_type} takes x as a list of one tensor, got {len(xs)}")
    a = _tensor(op, "x[0]", xs[0], dims=(2,))
    if group_list is None:
        _fail(op, f"group_type {group_type} needs group_list")
    if group_type == 0:
        for i, w in enumerate(ws):
            if w.shape[0] != a.shape[1]:
                _fail(op, f"weight[{i}] {tuple(w.shape)} does not take x's K = {a.shape[1]}")
        sizes = _group_sizes(op, group_list, group_list_type, len(ws), a.shape[0])
        pieces, start = [], 0
        for i, (size, w) in enumerate(zip(sizes, ws)):
            pieces.append(with_bias(_mm32(a[start:start + size], w), i).to(dtype))
            start += size
        if split_item in (0, 1):
            return pieces
        if len({w.shape[1] for w in ws}) != 1:
            _fail(op, "split_item 2/3 needs every weight to have one N")
        rest = a.new_zeros(a.shape[0] - start, ws[0].shape[1])
        return [torch.cat(pieces + [rest], dim=0)]
    if split_item != 3:
        _fail(op, f"group_type 2 (K axis) needs split_item 3, got {split_item}")
    if len(ws) != 1 or biases:
        _fail(op, "group_type 2 takes weight as a list of one [K, N] tensor and no bias")
    b = ws[0]
    if b.shape[0] != a.shape[1]:
        _fail(op, f"x[0] {tuple(a.shape)} and weight[0] {tuple(b.shape)} do not share K")
    if isinstance(group_list, torch.Tensor):
        groups = group_list.numel()
    elif isinstance(group_list, (list, tuple)):
        groups = len(group_list)
    else:
        groups = -1
    sizes = _group_sizes(op, group_list, group_list_type, groups, a.shape[1])
    outs, start = [], 0
    for size in sizes:
        outs.append(_mm32(a[:, start:start + size], b[start:start + size]))
        start += size
    return [torch.stack(outs).to(dtype)]


# --------------------------------------------------------------------------- MoE permute / unpermute

def _routing_map(op: str, tokens, routing_map):
    _tensor(op, "tokens", tokens, dims=(2,))
    _tensor(op, "routing_map", routing_map, dims=(2,))
    _same_device(op, tokens, routing_map=routing_map)
    if routing_map.dtype not in (torch.bool, torch.int8, torch.uint8):
        _fail(op, f"routing_map must be bool or int8 (1 = routed), got {routing_map.dtype}")
    if routing_map.shape[0] != tokens.shape[0]:
        _fail(op, f"routing_map has {routing_map.shape[0]} rows for {tokens.shape[0]} tokens")
    return routing_map.bool()


def _expert_major_tokens(routing_map: torch.Tensor) -> torch.Tensor:
    """Token id of each routed (token, expert) pair, experts in order, tokens ascending within."""
    num_tokens, num_experts = routing_map.shape
    token_ids = torch.arange(num_tokens, device=routing_map.device).expand(num_experts, -1)
    return token_ids.masked_select(routing_map.T)


def _topk(op: str, routing_map: torch.Tensor, num_out_tokens) -> int:
    num_tokens = routing_map.shape[0]
    counts = routing_map.sum(dim=1)
    topk = int(counts[0]) if num_tokens else 0
    if num_tokens and not bool((counts == topk).all()):
        _fail(op, f"every token must be routed to the same number of experts (torch_npu's "
                  f"permuted position i belongs to token i // topK), got counts {counts.tolist()}")
    if num_out_tokens is not None:
        if not isinstance(num_out_tokens, int) or num_out_tokens < 0:
            _fail(op, f"num_out_tokens must be an int >= 0 or None, got {num_out_tokens!r}")
        if num_tokens and num_out_tokens // num_tokens != topk:
            _fail(op, f"num_out_tokens {num_out_tokens} gives topK {num_out_tokens // num_tokens}, "
                      f"but the routing map routes each token to {topk} experts")
    return topk


def npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None, num_out_tokens=None,
                                           drop_and_pad=False):
    """``torch_npu.npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None,
    num_out_tokens=None, drop_and_pad=False) -> (permuted_tokens, permuted_probs, sorted_indices)``.

    CANN aclnnMoeTokenPermuteWithRoutingMap (drop_and_pad False): with ``first = arange(T)
    .expand(E, -1).masked_select(routing_map.T)`` (token ids, expert-major), ``sorted_indices =
    argsort(first)`` (int32: for token-major position i, where it lands), ``topK = num_out_tokens
    // T``, ``permuted_tokens[sorted_indices[i]] = tokens[i // topK]`` and ``permuted_probs =
    probs.T.masked_select(routing_map.T)`` (None without ``probs``). Reading chosen: the formula
    needs every token routed to exactly topK experts (DeepSeek-V3's top-k router without token
    dropping); other maps are rejected, and ``num_out_tokens`` None means topK from the map.
    ``drop_and_pad`` (capacity padding) is not implemented. Differentiable by autograd; MindSpeed's
    ``MoePermuteMaskMap`` calls ``..._grad`` explicitly instead.
    """
    op = "npu_moe_token_permute_with_routing_map"
    routing = _routing_map(op, tokens, routing_map)
    if drop_and_pad:
        _fail(op, "drop_and_pad=True (expert capacity padding) is not implemented by the rehearsal "
                  "stand-in")
    _topk(op, routing, num_out_tokens)
    first = _expert_major_tokens(routing)
    sorted_indices = torch.argsort(first, stable=True).to(torch.int32)
    permuted = tokens.index_select(0, first)
    permuted_probs = None
    if probs is not None:
        _tensor(op, "probs", probs, dims=(2,), floating=True)
        if probs.shape != routing.shape:
            _fail(op, f"probs {tuple(probs.shape)} must have routing_map's shape {tuple(routing.shape)}")
        permuted_probs = probs.T.masked_select(routing.T)
    return permuted, permuted_probs, sorted_indices


def npu_moe_token_permute_with_routing_map_grad(permuted_token_out_grad, probs_grad_out,
                                                sorted_indices, routing_map, experts_num,
                                                tokens_num, drop_and_pad):
    """``torch_npu.npu_moe_token_permute_with_routing_map_grad(permuted_token_out_grad,
    probs_grad_out, sorted_indices, routing_map, experts_num, tokens_num, drop_and_pad) ->
    (tokens_grad, probs_grad)``, as MindSpeed's ``MoePermuteMaskMap.backward`` calls it.

    The adjoint of the permute: ``tokens_grad[t] = sum_k grad[sorted_indices[t * topK + k]]``;
    ``probs_grad`` [T, E] holds ``probs_grad_out`` at the routed (token, expert) pairs
    (``probs_grad.T.masked_scatter(routing_map.T, probs_grad_out)``), zero elsewhere, and is None
    when ``probs_grad_out`` is None.
    """
    op = "npu_moe_token_permute_with_routing_map_grad"
    _tensor(op, "permuted_token_out_grad", permuted_token_out_grad, dims=(2,))
    _tensor(op, "sorted_indices", sorted_indices, dims=(1,))
    if drop_and_pad:
        _fail(op, "drop_and_pad=True is not implemented by the rehearsal stand-in")
    routing = routing_map.bool() if isinstance(routing_map, torch.Tensor) else routing_map
    _tensor(op, "routing_map", routing, dims=(2,))
    if tuple(routing.shape) != (tokens_num, experts_num):
        _fail(op, f"routing_map {tuple(routing.shape)} must be (tokens_num, experts_num) = "
                  f"({tokens_num}, {experts_num})")
    topk = _topk(op, routing, None)
    if sorted_indices.numel() != tokens_num * topk \
            or permuted_token_out_grad.shape[0] != sorted_indices.numel():
        _fail(op, f"sorted_indices ({sorted_indices.numel()}) and permuted_token_out_grad "
                  f"({permuted_token_out_grad.shape[0]} rows) must both have tokens_num * topK = "
                  f"{tokens_num * topk} entries")
    gathered = permuted_token_out_grad.index_select(0, sorted_indices.long())
    tokens_grad = _f32(gathered.view(tokens_num, topk, -1)).sum(dim=1)
    tokens_grad = tokens_grad.to(permuted_token_out_grad.dtype)
    probs_grad = None
    if probs_grad_out is not None:
        _tensor(op, "probs_grad_out", probs_grad_out, dims=(1,))
        if probs_grad_out.numel() != sorted_indices.numel():
            _fail(op, f"probs_grad_out has {probs_grad_out.numel()} entries, expected "
                      f"{sorted_indices.numel()}")
        probs_grad = probs_grad_out.new_zeros(experts_num, tokens_num)
        probs_grad = probs_grad.masked_scatter(routing.T, probs_grad_out).T.contiguous()
    return tokens_grad, probs_grad


def _unpermute_args(op, permuted_tokens, sorted_indices, restore_shape, probs, routing_map,
                    drop_and_pad):
    _tensor(op, "permuted_tokens", permuted_tokens, dims=(2,))
    _tensor(op, "sorted_indices", sorted_indices, dims=(1,))
    if drop_and_pad:
        _fail(op, "drop_and_pad=True is not implemented by the rehearsal stand-in")
    if restore_shape is None or len(restore_shape) != 2:
        _fail(op, f"restore_shape must be (tokens, hidden), got {restore_shape!r}")
    num_tokens, hidden = int(restore_shape[0]), int(restore_shape[1])
    if permuted_tokens.shape[1] != hidden:
        _fail(op, f"permuted_tokens' hidden size {permuted_tokens.shape[1]} must equal "
                  f"restore_shape's {hidden}")
    if permuted_tokens.shape[0] != sorted_indices.numel() or \
            (num_tokens and sorted_indices.numel() % num_tokens):
        _fail(op, f"sorted_indices ({sorted_indices.numel()}) must have one entry per permuted "
                  f"row ({permuted_tokens.shape[0]}), a multiple of the {num_tokens} tokens")
    topk = sorted_indices.numel() // num_tokens if num_tokens else 0
    permuted_probs = None
    if probs is not None:
        if routing_map is None:
            _fail(op, "probs needs routing_map (to place each probability)")
        _tensor(op, "routing_map", routing_map, dims=(2,))
        if routing_map.dtype not in (torch.bool, torch.int8, torch.uint8):
            _fail(op, f"routing_map must be bool or int8 (1 = routed), got {routing_map.dtype}")
        routing = routing_map.bool()
        if probs.shape != routing.shape:
            _fail(op, f"probs {tuple(probs.shape)} must have routing_map's shape "
                      f"{tuple(routing.shape)}")
        if _topk(op, routing, None) != topk:
            _fail(op, f"routing_map routes {_topk(op, routing, None)} experts per token, "
                      f"sorted_indices {topk}")
        permuted_probs = probs.T.masked_select(routing.T)
    return num_tokens, topk, permuted_probs


def _npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
                                              probs=None, routing_map=None, drop_and_pad=False):
    """``torch_npu._npu_moe_token_unpermute_with_routing_map(...) -> (unpermuted_tokens,
    out_index, permuted_token_id, permute_probs)``: the form MindSpeed's ``MoeUnpermuteMaskMap``
    calls (it keeps the extra outputs for the ``drop_and_pad`` backward only).

    CANN aclnnMoeTokenUnpermuteWithRoutingMap (drop_and_pad False): ``out[t] = sum_k
    permuted_tokens[p] * permuted_probs[p]`` with ``p = sorted_indices[t * topK + k]`` and
    ``permuted_probs = probs.T.masked_select(routing_map.T)`` (factor 1 without ``probs``).
    Readings chosen for the auxiliary outputs: ``out_index`` = ``sorted_indices``,
    ``permuted_token_id`` = the token of each permuted row, ``permute_probs`` = the permuted
    probabilities (None without ``probs``). Summed in fp32; differentiable by autograd.
    """
    op = "_npu_moe_token_unpermute_with_routing_map"
    num_tokens, topk, permuted_probs = _unpermute_args(
        op, permuted_tokens, sorted_indices, restore_shape, probs, routing_map, drop_and_pad)
    index = sorted_indices.long()
    rows = _f32(permuted_tokens)
    if permuted_probs is not None:
        rows = rows * _f32(permuted_probs).unsqueeze(1)
    out = rows.index_select(0, index).view(num_tokens, topk, -1).sum(dim=1)
    token_of_row = torch.empty_like(index)
    token_of_row[index] = torch.arange(index.numel(), device=index.device) // max(topk, 1)
    return (out.to(permuted_tokens.dtype), sorted_indices, token_of_row.to(torch.int32),
            permuted_probs)


def npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
                                             probs=None, routing_map=None, drop_and_pad=False):
    """``torch_npu.npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices,
    restore_shape, *, probs=None, routing_map=None, drop_and_pad=False) -> Tensor``: the
    unpermuted tokens of ``_npu_moe_token_unpermute_with_routing_map`` (see there)."""
    return _npu_moe_token_unpermute_with_routing_map(
        permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
        drop_and_pad=drop_and_pad)[0]


def npu_moe_token_unpermute_with_routing_map_grad(unpermuted_tokens_grad, out_index,
                                                  permuted_token_id, routing_map=None,
                                                  permuted_tokens=None, probs=None,
                                                  drop_and_pad=False, restore_shape=None):
    """``torch_npu.npu_moe_token_unpermute_with_routing_map_grad(unpermuted_tokens_grad,
    out_index, permuted_token_id, routing_map=None, permuted_tokens=None, probs=None,
    drop_and_pad=False, restore_shape=None) -> (permuted_tokens_grad, probs_grad)``.

    The adjoint of the unpermute, in the form MindSpeed calls without ``drop_and_pad``
    (``out_index`` and ``permuted_token_id`` both the permute's ``sorted_indices``): for row
    ``p = sorted_indices[t * topK + k]``, ``permuted_tokens_grad[p] = grad[t] * prob(p)`` and, with
    ``probs``, ``probs_grad[t, e(p)] = <grad[t], permuted_tokens[p]>`` ([T, E], zero off the map;
    None without ``probs``).
    """
    op = "npu_moe_token_unpermute_with_routing_map_grad"
    _tensor(op, "unpermuted_tokens_grad", unpermuted_tokens_grad, dims=(2,))
    if drop_and_pad:
        _fail(op, "drop_and_pad=True is not implemented by the rehearsal stand-in")
    _tensor(op, "out_index", out_index, dims=(1,))
    if restore_shape is None:
        restore_shape = tuple(unpermuted_tokens_grad.shape)
    if tuple(restore_shape) != tuple(unpermuted_tokens_grad.shape):
        _fail(op, f"restore_shape {tuple(restore_shape)} must be unpermuted_tokens_grad's shape "
                  f"{tuple(unpermuted_tokens_grad.shape)}")
    if probs is not None and permuted_tokens is None:
        _fail(op, "probs needs permuted_tokens (its gradient is <grad, permuted token>)")
    rows = permuted_tokens if permuted_tokens is not None else unpermuted_tokens_grad.new_empty(
        out_index.numel(), unpermuted_tokens_grad.shape[1])
    num_tokens, topk, permuted_probs = _unpermute_args(
        op, rows, out_index, restore_shape, probs, routing_map, drop_and_pad)
    index = out_index.long()
    token_of_row = torch.empty_like(index)
    token_of_row[index] = torch.arange(index.numel(), device=index.device) // max(topk, 1)
    grad = _f32(unpermuted_tokens_grad).index_select(0, token_of_row)
    probs_grad = None
    if permuted_probs is not None:
        routing = routing_map.bool()
        row_grads = (grad * _f32(permuted_tokens)).sum(dim=1)
        probs_grad = torch.zeros(routing.shape[1], routing.shape[0], dtype=grad.dtype,
                                 device=grad.device)
        probs_grad = probs_grad.masked_scatter(routing.T, row_grads).T.to(probs.dtype)
        grad = grad * _f32(permuted_probs).unsqueeze(1)
    return grad.to(unpermuted_tokens_grad.dtype), probs_grad


# --------------------------------------------------------------------------- MindSpeed kernels

def _gmm_group_list(op: str, group_list, group_list_type: int, groups: int, rows: int) -> list:
    return _group_sizes(op, group_list, group_list_type, groups, rows)


def _gmm_operands(op: str, x, weight):
    if not isinstance(x, (list, tuple)) or len(x) != 1:
        _fail(op, f"x must be a list of one [M, K] tensor, got {x!r:.80}")
    if not isinstance(weight, (list, tuple)) or len(weight) != 1:
        _fail(op, f"weight must be a list of one [E, K, N] tensor, got {weight!r:.80}")
    a = _tensor(op, "x[0]", x[0], dims=(2,), floating=True)
    w = _tensor(op, "weight[0]", weight[0], dims=(3,), floating=True)
    if w.shape[1] != a.shape[1]:
        _fail(op, f"weight[0] {tuple(w.shape)} does not take x[0]'s K = {a.shape[1]}")
    return a, w


def _gmm_kernel(group_list_type_of_builder: int):
    def npu_gmm(x, weight, bias, group_list, group_type, group_list_type):
        """MindSpeed grouped-matmul kernel ``npu_gmm([x], [weight], bias, group_list, group_type,
        group_list_type) -> [y]`` (``GMMFunction.forward``): x [M, K], weight [E, K, N], rows of x
        split by ``group_list`` (cumulative ends for ``grouped_matmul``, counts for
        ``grouped_matmul_v2``), ``y[rows_e] = x[rows_e] @ weight[e] (+ bias[e])``; group_type 0
        only (the one MindSpeed computes gradients for)."""
        op = "npu_gmm"
        a, w = _gmm_operands(op, x, weight)
        if group_type != 0:
            _fail(op, f"group_type must be 0 (M axis) on the rehearsal stand-in, got {group_type!r}")
        if group_list_type != group_list_type_of_builder:
            _fail(op, f"this builder's kernel takes group_list_type {group_list_type_of_builder}, "
                      f"got {group_list_type!r}")
        biases = None
        if bias:
            biases = list(bias[0].unbind(0)) if len(bias) == 1 and bias[0].dim() == 2 else list(bias)
        return npu_grouped_matmul([a], list(w.unbind(0)), bias=biases, group_list=group_list,
                                  split_item=2, group_type=0, group_list_type=group_list_type)

    def npu_gmm_backward(grad, x, weight, group_list, group_list_type):
        """MindSpeed kernel ``npu_gmm_backward([grad], [x], [weight], group_list,
        group_list_type) -> ([dx], [dw], [])``: ``dx[rows_e] = grad[rows_e] @ weight[e]^T``,
        ``dw[e] = x[rows_e]^T @ grad[rows_e]`` (fp32 accumulation, the weight's dtype); the bias
        gradient list is empty (MindSpeed rejects a bias that needs one)."""
        op = "npu_gmm_backward"
        a, w = _gmm_operands(op, x, weight)
        if group_list_type != group_list_type_of_builder:
            _fail(op, f"this builder's kernel takes group_list_type {group_list_type_of_builder}, "
                      f"got {group_list_type!r}")
        if not isinstance(grad, (list, tuple)) or len(grad) != 1:
            _fail(op, "grad must be a list of one [M, N] tensor")
        g = _tensor(op, "grad[0]", grad[0], dims=(2,), floating=True)
        if tuple(g.shape) != (a.shape[0], w.shape[2]):
            _fail(op, f"grad[0] {tuple(g.shape)} must be [M, N] = {(a.shape[0], w.shape[2])}")
        sizes = _gmm_group_list(op, group_list, group_list_type, w.shape[0], a.shape[0])
        dx = torch.zeros(a.shape, dtype=_acc_dtype(a.dtype), device=a.device)
        dw = torch.zeros(w.shape, dtype=_acc_dtype(w.dtype), device=w.device)
        start = 0
        for e, size in enumerate(sizes):
            rows = slice(start, start + size)
            dx[rows] = _mm32(g[rows], w[e].transpose(0, 1))
            dw[e] = _mm32(a[rows].transpose(0, 1), g[rows])
            start += size
        return [dx.to(a.dtype)], [dw.to(w.dtype)], []

    def npu_gmm_backward_fusion(grad, weight, group_list, group_list_type):
        """MindSpeed kernel ``npu_gmm_backward_fusion([grad], [weight], group_list,
        group_list_type) -> ([dx], [], [])``: the input gradient only; with gradient-accumulation
        fusion the weight gradient goes to ``main_grad`` through ``npu_groupmatmul_add_fp32``."""
        op = "npu_gmm_backward_fusion"
        if not isinstance(weight, (list, tuple)) or len(weight) != 1:
            _fail(op, "weight must be a list of one [E, K, N] tensor")
        w = _tensor(op, "weight[0]", weight[0], dims=(3,), floating=True)
        if not isinstance(grad, (list, tuple)) or len(grad) != 1:
            _fail(op, "grad must be a list of one [M, N] tensor")
        g = _tensor(op, "grad[0]", grad[0], dims=(2,), floating=True)
        if g.shape[1] != w.shape[2]:
            _fail(op, f"grad[0] {tuple(g.shape)} must have weight's N = {w.shape[2]}")
        if group_list_type != group_list_type_of_builder:
            _fail(op, f"this builder's kernel takes group_list_type {group_list_type_of_builder}, "
                      f"got {group_list_type!r}")
        dx = npu_grouped_matmul([g], [t.transpose(0, 1) for t in w.unbind(0)], group_list=group_list,
                                split_item=2, group_type=0, group_list_type=group_list_type)[0]
        return [dx], [], []

    return {"npu_gmm": npu_gmm, "npu_gmm_backward": npu_gmm_backward,
            "npu_gmm_backward_fusion": npu_gmm_backward_fusion}


def npu_matmul_add_fp32(grad_output: torch.Tensor, total_input: torch.Tensor,
                        grad: torch.Tensor) -> None:
    """MindSpeed kernel ``npu_matmul_add_fp32(grad_output, total_input, grad)``
    (``MatmulAddOpBuilder``; the wrapper in ``mindspeed/ops/npu_matmul_add.py`` swaps Megatron's
    ``(total_input, grad_output, main_grad)`` into this order): gradient-accumulation fusion,
    ``grad += grad_output^T @ total_input`` in place on the fp32 ``main_grad``, both inputs 2-D
    [tokens, out] and [tokens, in] as Megatron's linear backward passes them."""
    op = "npu_matmul_add_fp32"
    _tensor(op, "grad_output", grad_output, dims=(2,), floating=True)
    _tensor(op, "total_input", total_input, dims=(2,), floating=True)
    _tensor(op, "grad", grad, dims=(2,))
    _same_device(op, grad, grad_output=grad_output, total_input=total_input)
    if grad.dtype != torch.float32:
        _fail(op, f"grad (main_grad) must be float32, got {grad.dtype}")
    if grad_output.shape[0] != total_input.shape[0]:
        _fail(op, f"grad_output {tuple(grad_output.shape)} and total_input "
                  f"{tuple(total_input.shape)} must share the token count")
    if tuple(grad.shape) != (grad_output.shape[1], total_input.shape[1]):
        _fail(op, f"grad {tuple(grad.shape)} must be [out, in] = "
                  f"{(grad_output.shape[1], total_input.shape[1])}")
    grad.add_(_mm32(grad_output.transpose(0, 1), total_input))


def npu_groupmatmul_add_fp32(x: torch.Tensor, dy: torch.Tensor, grouplist: torch.Tensor,
                             grad: torch.Tensor) -> None:
    """MindSpeed kernel ``npu_groupmatmul_add_fp32(x, dy, grouplist, grad)``
    (``GroupMatmulAddOpBuilder``; ATB GroupedMatmulInplaceAdd): for group e over the token rows
    ``grouplist`` delimits (cumulative ends; MindSpeed cumsums counts before calling),
    ``grad[e] += x[rows_e]^T @ dy[rows_e]`` in place on the fp32 ``main_grad``, viewed as
    [E, K, N] (its memory holds E blocks of [K, N], e.g. a [E*K, N] or a [K, E*N] main_grad of a
    weight the experts view as [E, K, N])."""
    op = "npu_groupmatmul_add_fp32"
    _tensor(op, "x", x, dims=(2,), floating=True)
    _tensor(op, "dy", dy, dims=(2,), floating=True)
    _tensor(op, "grad", grad)
    if grad.dtype != torch.float32 or not grad.is_contiguous():
        _fail(op, f"grad (main_grad) must be a contiguous float32 tensor, got {grad.dtype}")
    if x.shape[0] != dy.shape[0]:
        _fail(op, f"x {tuple(x.shape)} and dy {tuple(dy.shape)} must share the token count")
    groups = grouplist.numel() if isinstance(grouplist, torch.Tensor) else len(grouplist)
    sizes = _group_sizes(op, grouplist, 0, groups, x.shape[0])
    k, n = x.shape[1], dy.shape[1]
    if grad.numel() != groups * k * n:
        _fail(op, f"grad has {grad.numel()} elements, expected groups * K * N = {groups} * {k} * {n}")
    blocks = grad.view(groups, k, n)
    start = 0
    for e, size in enumerate(sizes):
        blocks[e].add_(_mm32(x[start:start + size].transpose(0, 1), dy[start:start + size]))
        start += size


def npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens=None,
                          padded_mode: bool = False):
    """MindSpeed kernel ``npu_moe_token_permute(tokens, indices, num_out_tokens, padded_mode) ->
    (permuted_tokens, sorted_indices)`` (``MoeTokenPermuteOpBuilder``), the index-based permute
    of Megatron's ``moe_utils.permute``: ``indices`` [T, topK] expert ids, ``sorted_indices =
    stable argsort(indices.flatten())``, ``permuted_tokens = tokens[sorted_indices // topK]``, the
    first ``num_out_tokens`` rows (all when None or 0). ``padded_mode`` is not implemented.
    Differentiable by autograd (the compiled op carries its backward)."""
    op = "npu_moe_token_permute"
    _tensor(op, "tokens", tokens, dims=(2,))
    _tensor(op, "indices", indices, dims=(1, 2))
    if padded_mode:
        _fail(op, "padded_mode=True is not implemented by the rehearsal stand-in")
    if indices.is_floating_point():
        _fail(op, f"indices must be an integer tensor, got {indices.dtype}")
    if indices.shape[0] != tokens.shape[0]:
        _fail(op, f"indices has {indices.shape[0]} rows for {tokens.shape[0]} tokens")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    flat = indices.reshape(-1)
    if num_out_tokens is None or num_out_tokens == 0:
        num_out_tokens = flat.numel()
    if not isinstance(num_out_tokens, int) or not 0 < num_out_tokens <= flat.numel():
        _fail(op, f"num_out_tokens must be in [1, {flat.numel()}] or None, got {num_out_tokens!r}")
    sorted_indices = torch.argsort(flat, stable=True)[:num_out_tokens]
    permuted = tokens.index_select(0, sorted_indices // topk)
    return permuted, sorted_indices.to(torch.int32)


def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                            probs=None, padded_mode: bool = False, restore_shape=None):
    """MindSpeed kernel ``npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs,
    padded_mode, restore_shape) -> Tensor`` (``MoeTokenUnpermuteOpBuilder``), the inverse of
    ``npu_moe_token_permute``: row i of ``permuted_tokens`` goes back to flat slot
    ``sorted_indices[i]`` of [T * topK, H] (unfilled slots are 0), each slot is weighted by
    ``probs.flatten()`` (topK = ``probs.shape[1]``, else 1) and the topK slots of a token are
    summed (fp32). ``padded_mode`` is not implemented; differentiable by autograd."""
    op = "npu_moe_token_unpermute"
    _tensor(op, "permuted_tokens", permuted_tokens, dims=(2,))
    _tensor(op, "sorted_indices", sorted_indices, dims=(1,))
    if padded_mode:
        _fail(op, "padded_mode=True is not implemented by the rehearsal stand-in")
    if sorted_indices.numel() != permuted_tokens.shape[0]:
        _fail(op, f"sorted_indices ({sorted_indices.numel()}) must have one entry per permuted row "
              f"({permuted_tokens.shape[0]})")
    topk = 1
    if probs is not None:
        _tensor(op, "probs", probs, dims=(2,), floating=True)
        topk = probs.shape[1]
        num_tokens = probs.shape[0]
    else:
        num_tokens = sorted_indices.numel()
    if restore_shape is not None and tuple(restore_shape)[0] != num_tokens:
        _fail(op, f"restore_shape {tuple(restore_shape)} does not match {num_tokens} tokens")
    slots = num_tokens * topk
    index = sorted_indices.long()
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= slots):
        _fail(op, f"sorted_indices must lie in [0, {slots}), the flat (token, k) slots")
    flat = torch.zeros(slots, permuted_tokens.shape[1], dtype=_acc_dtype(permuted_tokens.dtype),
                       device=permuted_tokens.device)
    flat = flat.index_copy(0, index, _f32(permuted_tokens))
    if probs is not None:
        flat = flat * _f32(probs).reshape(-1, 1)
    return flat.view(num_tokens, topk, -1).sum(dim=1).to(permuted_tokens.dtype)


def npu_apply_fused_adamw_v2(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, state_step, lr,
                             beta1, beta2, weight_decay, eps, amsgrad, maximize) -> None:
    """MindSpeed kernel ``npu_apply_fused_adamw_v2(param, grad, exp_avg, exp_avg_sq,
    max_exp_avg_sq, state_step, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize)``
    (``FusedAdamWV2OpBuilder``; the swap optimizer's step), in place: AdamW as torch.optim.AdamW
    documents it for step ``state_step`` (already incremented): ``param *= 1 - lr * weight_decay``;
    ``m = beta1 m + (1 - beta1) g``; ``v = beta2 v + (1 - beta2) g^2``; with amsgrad
    ``vmax = max(vmax, v)``; ``param -= lr / (1 - beta1^t) * m / (sqrt(v or vmax) / sqrt(1 -
    beta2^t) + eps)``; ``g`` negated when ``maximize``. Moments in their own dtype, math in fp32.
    """
    op = "npu_apply_fused_adamw_v2"
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq)):
        _tensor(op, name, t, floating=True)
        if t.shape != param.shape:
            _fail(op, f"{name} {tuple(t.shape)} must have param's shape {tuple(param.shape)}")
    if amsgrad and (not isinstance(max_exp_avg_sq, torch.Tensor)
                    or max_exp_avg_sq.shape != param.shape):
        _fail(op, "amsgrad needs max_exp_avg_sq of param's shape")
    step = int(state_step.item()) if isinstance(state_step, torch.Tensor) else state_step
    if not isinstance(step, int) or step < 1:
        _fail(op, f"state_step must be an int >= 1 (the step being taken), got {state_step!r}")
    if not 0 <= beta1 < 1 or not 0 <= beta2 < 1:
        _fail(op, f"beta1 and beta2 must be in [0, 1), got {beta1}, {beta2}")
    g = _f32(grad)
    if maximize:
        g = -g
    p = _f32(param) * (1 - lr * weight_decay)
    m = _f32(exp_avg) * beta1 + g * (1 - beta1)
    v = _f32(exp_avg_sq) * beta2 + g * g * (1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    second = v
    if amsgrad:
        second = torch.maximum(_f32(max_exp_avg_sq), v)
        max_exp_avg_sq.copy_(second)
    denom = second.sqrt() / math.sqrt(1 - beta2 ** step) + eps
    p = p - (lr / (1 - beta1 ** step)) * m / denom
    param.copy_(p)


def npu_apply_adam_w(beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad,
                     max_grad_norm=None, amsgrad=False, maximize=False, *, out=None):
    """``torch_npu.npu_apply_adam_w(beta1_power, beta2_power, lr, weight_decay, beta1, beta2,
    epsilon, grad, max_grad_norm, amsgrad, maximize, out=(var, m, v)) -> (var, m, v)``, in place
    on ``out`` (MindSpeed-LLM's ``O2AdamW``; torch_npu implements only the ``out=`` form).

    torch_npu's ApplyAdamW: ``beta1_power`` / ``beta2_power`` are the powers *before* this step
    (the kernel multiplies them by ``beta1`` / ``beta2``; MindSpeed-LLM passes ``beta**(step-1)``);
    ``g = -grad`` when ``maximize``; ``m = beta1 m + (1 - beta1) g``; ``v = beta2 v + (1 - beta2)
    g^2``; ``var *= 1 - lr * weight_decay``; ``denom = sqrt(v' / (1 - beta2_power * beta2)) +
    epsilon`` with ``v' = max(max_grad_norm, v)`` under ``amsgrad``, else ``v``; ``var -= lr * m /
    (1 - beta1_power * beta1) / denom``. Reading chosen: ``max_grad_norm`` is read, not updated
    (the op returns only var, m, v). Math in fp32.
    """
    op = "npu_apply_adam_w"
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        _fail(op, "out=(var, m, v) is required: torch_npu implements npu_apply_adam_w only in its "
                  "out= form")
    var, m, v = out
    _tensor(op, "grad", grad, floating=True)
    for name, t in (("var", var), ("m", m), ("v", v)):
        _tensor(op, name, t, floating=True)
        if t.shape != grad.shape:
            _fail(op, f"{name} {tuple(t.shape)} must have grad's shape {tuple(grad.shape)}")
    if amsgrad and (not isinstance(max_grad_norm, torch.Tensor)
                    or max_grad_norm.shape != grad.shape):
        _fail(op, "amsgrad needs max_grad_norm, a tensor of grad's shape")
    if not 0 <= beta1 < 1 or not 0 <= beta2 < 1:
        _fail(op, f"beta1 and beta2 must be in [0, 1), got {beta1}, {beta2}")
    bias1, bias2 = 1 - beta1_power * beta1, 1 - beta2_power * beta2
    if bias1 <= 0 or bias2 <= 0:
        _fail(op, f"1 - beta1_power * beta1 and 1 - beta2_power * beta2 must be > 0, got {bias1}, "
                  f"{bias2}")
    g = -_f32(grad) if maximize else _f32(grad)
    m_new = _f32(m) * beta1 + g * (1 - beta1)
    v_new = _f32(v) * beta2 + g * g * (1 - beta2)
    second = torch.maximum(_f32(max_grad_norm), v_new) if amsgrad else v_new
    denom = torch.sqrt(second / bias2) + epsilon
    var_new = _f32(var) * (1 - lr * weight_decay) - lr * m_new / bias1 / denom
    m.copy_(m_new)
    v.copy_(v_new)
    var.copy_(var_new)
    return var, m, v


OPERATORS: dict[str, Callable] = {
    "npu_rms_norm": npu_rms_norm,
    "npu_apply_adam_w": npu_apply_adam_w,
    "npu_rotary_mul": npu_rotary_mul,
    "npu_rotary_position_embedding": npu_rotary_position_embedding,
    "npu_swiglu": npu_swiglu,
    "npu_swiglu_backward": npu_swiglu_backward,
    "npu_scaled_masked_softmax": npu_scaled_masked_softmax,
    "npu_fusion_attention": npu_fusion_attention,
    "npu_fusion_attention_grad": npu_fusion_attention_grad,
    "npu_grouped_matmul": npu_grouped_matmul,
    "npu_moe_token_permute_with_routing_map": npu_moe_token_permute_with_routing_map,
    "npu_moe_token_permute_with_routing_map_grad": npu_moe_token_permute_with_routing_map_grad,
    "npu_moe_token_unpermute_with_routing_map": npu_moe_token_unpermute_with_routing_map,
    "_npu_moe_token_unpermute_with_routing_map": _npu_moe_token_unpermute_with_routing_map,
    "npu_moe_token_unpermute_with_routing_map_grad": npu_moe_token_unpermute_with_routing_map_grad,
}
"""torch_npu attribute name -> host implementation, for operators called as ``torch_npu.<name>``."""

MINDSPEED_KERNELS: dict[str, dict[str, Callable]] = {
    "grouped_matmul": _gmm_kernel(0),
    "grouped_matmul_v2": _gmm_kernel(1),
    "npu_matmul_add_fp32": {"npu_matmul_add_fp32": npu_matmul_add_fp32},
    "npu_groupmatmul_add_fp32": {"npu_groupmatmul_add_fp32": npu_groupmatmul_add_fp32},
    "npu_moe_token_permute": {"npu_moe_token_permute": npu_moe_token_permute},
    "npu_moe_token_unpermute": {"npu_moe_token_unpermute": npu_moe_token_unpermute},
    "npu_rotary_position_embedding": {
        "npu_rotary_position_embedding": npu_rotary_position_embedding},
    "npu_apply_fused_adamw_v2": {"npu_apply_fused_adamw_v2": npu_apply_fused_adamw_v2},
}
"""MindSpeed op builder NAME (``GMMOpBuilder`` "grouped_matmul", ``GMMV2OpBuilder``
"grouped_matmul_v2", ``MatmulAddOpBuilder``, ``GroupMatmulAddOpBuilder``,
``MoeTokenPermuteOpBuilder``, ``MoeTokenUnpermuteOpBuilder``, ``RotaryPositionEmbeddingOpBuilder``,
``FusedAdamWV2OpBuilder``) -> {function the ``mindspeed/ops`` wrapper calls on the loaded module ->
host implementation}. Not provided: ``swiglu`` / ``rms_norm`` (``SwigluOpBuilder``,
``RmsNormOpBuilder``: no caller in MindSpeed 2.2.0 loads them; the path calls torch_npu's
``npu_swiglu`` / ``npu_rms_norm``), ``fusion_attention_v2`` (ALiBi ``pse`` only), quantised GMMs,
communication-fused and ring-attention-update kernels."""

NOT_IMPLEMENTED: dict[str, str] = {
    "npu_all_gather_base_mm": "fuses an HCCL all-gather into the matmul (MindSpeed's MC2 / CoC "
                              "tensor parallelism); needs HCCL",
    "npu_mm_reduce_scatter_base": "fuses an HCCL reduce-scatter into the matmul (MC2 / CoC); "
                                  "needs HCCL",
    "npu_prompt_flash_attention": "inference attention (generation), not the training path",
    "npu_incre_flash_attention": "inference attention (generation), not the training path",
    "npu_fusion_attention_v2": "MindSpeed-LLM calls it only with --mla-fa-divide-qk, which the "
                               "recipe does not set",
    "npu_apply_fused_ema_adamw": "the EMA AdamW optimizer, which the recipe does not select",
    "npu_hans_encode": "checkpoint compression, not the training path",
    "npu_hans_decode": "checkpoint compression, not the training path",
}
"""torch_npu operators MindSpeed 2.2.0 / MindSpeed-LLM 2.2.0 call that the stand-in does not
implement, with the reason; the stand-in package names the operator (and this reason) when asked
for one, instead of a no-op."""

MINDSPEED_KERNELS_NOT_IMPLEMENTED: dict[str, str] = {
    "swiglu": "no caller loads SwigluOpBuilder in MindSpeed 2.2.0 (the path calls "
              "torch_npu.npu_swiglu)",
    "rms_norm": "no caller loads RmsNormOpBuilder in MindSpeed 2.2.0 (the path calls "
                "torch_npu.npu_rms_norm)",
    "fusion_attention_v2": "MindSpeed's --use-fusion-attn-v2 (ALiBi pse) only",
    "npu_ring_attention_update": "ring context parallelism (context_parallel_size > 1) only",
    "quant_grouped_matmul": "quantised grouped matmul, not the bf16 training path",
    "weight_quant_grouped_matmul": "quantised grouped matmul, not the bf16 training path",
    "npu_apply_fused_ema_adamw": "the EMA AdamW optimizer, which the recipe does not select",
    "npu_alltoall_allgather_bmm": "communication-fused batched matmul; needs HCCL",
    "npu_bmm_reducescatter_alltoall": "communication-fused batched matmul; needs HCCL",
    "npu_grouped_mat_mul_all_reduce": "communication-fused grouped matmul; needs HCCL",
    "npu_mm_all_reduce_add_rms_norm": "communication-fused matmul + RMSNorm; needs HCCL",
    "npu_mm_all_reduce_add_rms_norm_": "communication-fused matmul + RMSNorm; needs HCCL",
    "lcal": "MindSpeed's CoC communication library; needs HCCL",
    "npu_dropout_add_layer_norm": "not called on the DeepSeek-V3 path",
    "npu_ffn": "not called on the DeepSeek-V3 path",
    "adaptive_cp": "adaptive context parallelism only",
    "algorithm": "--reuse-fp32-param only (reuse_data_ptr), which MindSpeed refuses with the swap "
                 "optimizer the recipe uses",
    "smart_swap": "MindSpeed's smart swap memory feature, not enabled by the recipe",
    "AdaptiveRecomputing": "MindSpeed's adaptive recomputing feature, not enabled by the recipe",
}
"""MindSpeed op builder names the stand-in does not answer, with the reason."""
