"""A request's KV rows in vLLM V1's paged cache: read from its blocks on the rank it leaves, written
into blocks allocated for it on the rank it joins. The KV half of moving a request inside vLLM's
engine (docs/ROLLOUT.md, "What remains for vLLM on a device"), written against vLLM 0.9.1's own
``KVCacheManager`` (block allocation, block ids, free) and ``Request``; the scheduler and worker
side of the move (taking the request out of the running list, the worker's InputBatch, the
request's generator) is not written.

The cache tensors are those the worker binds per attention layer; in vLLM's MLA layout (the CPU
platform's engine allocates the same, verl_patches/rigs/cpu/engine.py) one tensor per layer
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``: a request's token t sits in row
``t % block_size`` of its block ``t // block_size``. A move carries
``layers x tokens x (kv_lora_rank + qk_rope_head_dim) x dtype bytes``. Device tensors stay where they
are: the rows are gathered on the cache's device, and verl_patches/rollout/long_tail/kv_transfer.py carries them
to the destination's device over a device process group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


class KVBlocksError(RuntimeError):
    """A request's blocks do not hold what the move needs; the message names the request."""


def _check_caches(kv_caches: Sequence[torch.Tensor]) -> None:
    if not kv_caches:
        raise KVBlocksError("no KV cache tensors (the engine's KV cache is not initialised)")
    for i, c in enumerate(kv_caches):
        if c.dim() != 3:
            raise KVBlocksError(f"KV cache {i} has shape {tuple(c.shape)}; the MLA layout is "
                                "[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]")


def read_rows(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], num_tokens: int) -> list[torch.Tensor]:
    """The first ``num_tokens`` rows of a request whose block table is ``block_ids``, per layer
    ([num_tokens, width] each, copies)."""
    _check_caches(kv_caches)
    out = []
    for c in kv_caches:
        need = math.ceil(num_tokens / c.shape[1])
        if len(block_ids) < need:
            raise KVBlocksError(f"{num_tokens} tokens need {need} blocks of {c.shape[1]}, the request holds "
                                f"{len(block_ids)}")
        idx = torch.tensor(list(block_ids[:need]), dtype=torch.long, device=c.device)
        out.append(c.index_select(0, idx).reshape(-1, c.shape[-1])[:num_tokens].clone())
    return out


def write_rows(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
    """Write each layer's ``rows`` [tokens, width] into the blocks ``block_ids``, from the first row."""
    _check_caches(kv_caches)
    if len(rows) != len(kv_caches):
        raise KVBlocksError(f"{len(rows)} layers of rows for {len(kv_caches)} KV cache tensors")
    for c, r in zip(kv_caches, rows):
        if r.dim() != 2 or r.shape[-1] != c.shape[-1] or r.dtype != c.dtype:
            raise KVBlocksError(f"rows {tuple(r.shape)} {r.dtype} do not fit a cache of width {c.shape[-1]} {c.dtype}")
        size = c.shape[1]
        for t0 in range(0, r.shape[0], size):
            block = block_ids[t0 // size]
            chunk = r[t0:t0 + size]
            c[block, :chunk.shape[0]].copy_(chunk)


def export_request(manager: Any, request: Any, kv_caches: Sequence[torch.Tensor]) -> dict:
    """The KV of ``request`` (vLLM's Request) on the rank it leaves: its computed tokens' rows, read
    through the real ``KVCacheManager``'s block table; then its blocks go back to the pool."""
    groups = manager.get_block_ids(request.request_id)
    if len(groups) != 1:
        raise KVBlocksError(f"request {request.request_id}: {len(groups)} KV cache groups; one (full attention, "
                            "MLA) is supported")
    n = int(request.num_computed_tokens)
    if n <= 0:
        raise KVBlocksError(f"request {request.request_id} has no computed tokens to move")
    rows = read_rows(kv_caches, groups[0], n)
    manager.free(request)
    return {"num_tokens": n, "rows": rows}


def import_request(manager: Any, request: Any, payload: dict, kv_caches: Sequence[torch.Tensor]) -> list[int]:
    """Blocks for ``request`` (a fresh vLLM Request holding the moved prompt + generated tokens) from
    the real ``KVCacheManager`` of the rank it joins, filled with the moved rows; the request's computed
    tokens set to theirs. Returns its block ids. A full pool is an error (the plan's capacity must
    count KV blocks, not only sequences)."""
    n = int(payload["num_tokens"])
    if request.num_computed_tokens:
        raise KVBlocksError(f"request {request.request_id} already has {request.num_computed_tokens} computed tokens")
    if n > request.num_tokens:
        raise KVBlocksError(f"request {request.request_id}: {n} moved KV rows for {request.num_tokens} tokens")
    blocks = manager.allocate_slots(request, n)
    if blocks is None:
        raise KVBlocksError(f"request {request.request_id}: no free KV blocks for {n} tokens on this rank")
    ids = manager.get_block_ids(request.request_id)[0]
    write_rows(kv_caches, ids, payload["rows"])
    request.num_computed_tokens = n
    return list(ids)


def move_bytes(kv_caches: Sequence[torch.Tensor], num_tokens: int) -> int:
    """Bytes of KV one move of a request of ``num_tokens`` carries: layers x tokens x width x dtype size."""
    _check_caches(kv_caches)
    return sum(num_tokens * c.shape[-1] * c.element_size() for c in kv_caches)
