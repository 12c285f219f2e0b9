"""Grouped matmul: ``torch_npu.npu_grouped_matmul`` (and the group-size reading MindSpeed's GMM
kernels share).
"""

from __future__ import annotations

import torch

from verl_patches.rigs.npu_rehearsal.ops.common import _f32, _fail, _same_device, _tensor


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
