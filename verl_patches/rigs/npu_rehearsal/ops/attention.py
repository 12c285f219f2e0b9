"""Fused attention: ``torch_npu.npu_fusion_attention`` and its grad (layouts, sparse modes, masks,
dropout, the softmax statistics).
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_patches.rigs.npu_rehearsal.ops.common import COMPRESSED_MASK_SIZE, INT_MAX, _f32, _fail, _same_device, _tensor


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
