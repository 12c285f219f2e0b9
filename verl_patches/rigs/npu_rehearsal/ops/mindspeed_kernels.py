"""MindSpeed's compiled kernels answered on the host (grouped matmul, matmul-add into fp32 gradients,
the index-based MoE permute / unpermute, fused AdamW) and torch_npu's ``npu_apply_adam_w``.
"""

from __future__ import annotations

import math

import torch

from verl_patches.rigs.npu_rehearsal.ops.common import _acc_dtype, _f32, _fail, _same_device, _tensor
from verl_patches.rigs.npu_rehearsal.ops.grouped_matmul import _group_sizes, _mm32, npu_grouped_matmul


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
    (permuted_tokens, sorted_indices)`` (``MoeTokenPermuteOpBuilder``; CANN aclnnMoeTokenPermute), the
    index-based permute of Megatron's ``moe_utils.permute``: ``indices`` [T, topK] (or [T]) expert ids; the
    forward order ``order = stable argsort(indices.flatten())`` (Megatron's ``sorted_indices``);
    ``permuted_tokens = tokens[order[:n] // topK]`` with ``n = min(num_out_tokens, T * topK)`` when
    ``num_out_tokens > 0``, else ``T * topK + num_out_tokens`` (None is 0: every slot).

    ``sorted_indices`` is not Megatron's: MindSpeed's own C++ (mindspeed/ops/csrc/cann/npu_moe_token_permute.cpp)
    says the aclnn operator's index differs from Megatron's and is not sliced. It is the inverse of the forward
    order, int32, one entry per flat (token, k) slot: ``sorted_indices[order[i]] = i``, the row of
    ``permuted_tokens`` slot ``t * topK + k`` lands in (>= n for a slot dropped by ``num_out_tokens``);
    ``npu_moe_token_unpermute`` reads it so. ``padded_mode`` is not implemented (the C++ refuses it too).
    Differentiable by autograd (the compiled op carries its backward)."""
    op = "npu_moe_token_permute"
    _tensor(op, "tokens", tokens, dims=(2,))
    _tensor(op, "indices", indices, dims=(1, 2))
    if padded_mode:
        _fail(op, "padded_mode=True is not implemented by the rehearsal stand-in (nor by MindSpeed's kernel)")
    if indices.is_floating_point():
        _fail(op, f"indices must be an integer tensor, got {indices.dtype}")
    if indices.shape[0] != tokens.shape[0]:
        _fail(op, f"indices has {indices.shape[0]} rows for {tokens.shape[0]} tokens")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    flat = indices.reshape(-1)
    if num_out_tokens is None:
        num_out_tokens = 0
    if not isinstance(num_out_tokens, int):
        _fail(op, f"num_out_tokens must be an int or None, got {num_out_tokens!r}")
    # The kernel's own rule (npu_moe_token_permute.cpp): a positive count is capped at the slots, zero or a
    # negative one counts back from them.
    rows = min(num_out_tokens, flat.numel()) if num_out_tokens > 0 else flat.numel() + num_out_tokens
    if rows < 0:
        _fail(op, f"num_out_tokens {num_out_tokens} leaves {rows} rows of the {flat.numel()} slots")
    order = torch.argsort(flat, stable=True)
    permuted = tokens.index_select(0, order[:rows] // topk)
    sorted_indices = torch.empty_like(order)
    sorted_indices[order] = torch.arange(order.numel(), device=order.device)
    return permuted, sorted_indices.to(torch.int32)


def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                            probs=None, padded_mode: bool = False, restore_shape=None):
    """MindSpeed kernel ``npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs,
    padded_mode, restore_shape) -> Tensor`` (``MoeTokenUnpermuteOpBuilder``; CANN aclnnMoeTokenUnpermute), the
    inverse of ``npu_moe_token_permute``: ``sorted_indices`` is the permute's, one entry per flat (token, k)
    slot (unsliced: the C++ takes the token count as ``sorted_indices.size(0) / topK``, topK =
    ``probs.shape[1]``, else 1), and ``out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t * topK +
    k]]`` (factor 1 without ``probs``; summed in fp32). Reading chosen: a slot whose row is past
    ``permuted_tokens`` (dropped by the permute's ``num_out_tokens``) adds nothing, as Megatron's unpermute
    leaves a dropped slot zero. ``padded_mode`` is not implemented; differentiable by autograd."""
    op = "npu_moe_token_unpermute"
    _tensor(op, "permuted_tokens", permuted_tokens, dims=(2,))
    _tensor(op, "sorted_indices", sorted_indices, dims=(1,))
    if padded_mode:
        _fail(op, "padded_mode=True is not implemented by the rehearsal stand-in (nor by MindSpeed's kernel)")
    if sorted_indices.is_floating_point():
        _fail(op, f"sorted_indices must be an integer tensor, got {sorted_indices.dtype}")
    slots = sorted_indices.numel()
    topk = 1
    if probs is not None:
        _tensor(op, "probs", probs, dims=(2,), floating=True)
        topk = probs.shape[1]
    if topk == 0 or slots % topk:
        _fail(op, f"sorted_indices ({slots}) must have one entry per (token, k) slot: a multiple of topK {topk}")
    num_tokens = slots // topk
    if probs is not None and probs.shape[0] != num_tokens:
        _fail(op, f"probs has {probs.shape[0]} rows; sorted_indices holds {num_tokens} tokens of topK {topk}")
    if restore_shape is not None and tuple(restore_shape)[0] != num_tokens:
        _fail(op, f"restore_shape {tuple(restore_shape)} does not match {num_tokens} tokens")
    rows = permuted_tokens.shape[0]
    if rows > slots:
        _fail(op, f"permuted_tokens has {rows} rows for {slots} slots (sorted_indices is the permute's, unsliced)")
    index = sorted_indices.long()
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= slots):
        _fail(op, f"sorted_indices must lie in [0, {slots}), the permuted rows of the (token, k) slots")
    # Rows rows..slots-1 stand for the dropped slots: zero, so they add nothing to their token.
    padded = torch.cat([_f32(permuted_tokens), permuted_tokens.new_zeros(slots - rows, permuted_tokens.shape[1],
                                                                         dtype=_acc_dtype(permuted_tokens.dtype))])
    flat = padded.index_select(0, index)
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
