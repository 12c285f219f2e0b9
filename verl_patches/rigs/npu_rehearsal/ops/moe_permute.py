"""MoE token permute / unpermute with a routing map: torch_npu's ``npu_moe_token_permute_with_routing_map``,
``npu_moe_token_unpermute_with_routing_map`` and their grads.
"""

from __future__ import annotations

import torch

from verl_patches.rigs.npu_rehearsal.ops.common import _f32, _fail, _same_device, _tensor


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
