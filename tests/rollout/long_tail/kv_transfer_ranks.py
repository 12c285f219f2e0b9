"""Per-rank bodies for test_kv_transfer.py and test_kv_transfer_gpu.py (next to them): spawned processes
import them by name. torch and verl_patches.rollout.long_tail.kv_transfer only (the GPU test's machine has no vLLM)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from verl_patches.rollout.long_tail import kv_transfer

LAYERS = 3
WIDTH = 576  # DeepSeek-V3's MLA row: kv_lora_rank 512 + qk_rope_head_dim 64


def plan(world: int, seed: int = 0, per_pair: int = 3) -> list:
    """Random moves, the same on every rank: every rank sends to a random other rank and receives from
    one (so a rank both sends and receives), ``per_pair`` requests per pair, ids unique."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(world, generator=g).tolist()
    dst_of = {perm[i]: perm[(i + 1) % world] for i in range(world)}  # a cycle: no rank sends to itself
    moves, rid = [], 0
    for src in range(world):
        for _ in range(per_pair):
            moves.append(SimpleNamespace(request=rid, src=src, dst=dst_of[src]))
            rid += 1
    order = torch.randperm(len(moves), generator=g).tolist()  # pairs interleaved in the moves list
    return [moves[i] for i in order]


def rows_of(rid: int, device: torch.device, tokens: int | None = None) -> dict:
    """Request ``rid``'s payload as vLLM's move builds it (kv_blocks.export_request's KV entry): its
    tokens' MLA rows per layer, bf16, random bits (the same on any rank), plus non-KV fields."""
    g = torch.Generator().manual_seed(1000 + rid)
    n = tokens if tokens is not None else int(torch.randint(1, 40, (1,), generator=g))
    rows = [torch.randn(n, WIDTH, generator=g).to(torch.bfloat16).to(device) for _ in range(LAYERS)]
    return {"prompt_token_ids": list(range(rid, rid + 5)), "kv": {"num_tokens": n, "rows": rows},
            "generator": torch.Generator().manual_seed(rid).get_state()}


def exchange_rank(rank: int, world: int, backend: str, seed: int) -> dict:
    """The random moves over a ``backend`` KV group (gloo host group for the rest). Returns per received
    request: bit-exact arrival, the received rows' devices; and what this rank sent."""
    host = dist.new_group(list(range(world)), backend="gloo")
    kv_group = dist.new_group(list(range(world)), backend=backend) if backend != "gloo" else host
    device = kv_transfer.prepare(kv_group)
    moves = plan(world, seed)
    payloads = {m.request: rows_of(m.request, device) for m in moves if m.src == rank}
    received, sent = kv_transfer.transfer(moves, payloads, host, kv_group)
    out = {"sent": sent, "received": {}, "device": str(device)}
    for rid, p in received.items():
        want = rows_of(rid, torch.device("cpu"))
        rows = p["kv"]["rows"]
        out["received"][rid] = {
            "exact": p["kv"]["num_tokens"] == want["kv"]["num_tokens"] and len(rows) == LAYERS
            and all(torch.equal(a.cpu(), b) for a, b in zip(rows, want["kv"]["rows"])),
            "devices": sorted({str(r.device) for r in rows}),
            "dtypes": sorted({str(r.dtype) for r in rows}),
            "rest": p["prompt_token_ids"] == want["prompt_token_ids"]
            and torch.equal(p["generator"], want["generator"]),
        }
    out["storages"] = len({r.untyped_storage().data_ptr() for p in received.values() for r in p["kv"]["rows"]})
    return out


def errors_rank(rank: int, world: int) -> dict:
    """Bad input on gloo, each caught on the rank it concerns, named (the others do not block: every
    case is refused before anything is posted)."""
    host = dist.new_group(list(range(world)), backend="gloo")
    kv_transfer.prepare(host)
    moves = plan(world, 1)
    mine = [m for m in moves if m.src == rank]
    out = {}
    payloads = {m.request: rows_of(m.request, torch.device("cpu")) for m in mine[1:]}  # the first one is missing
    try:
        kv_transfer.transfer(moves, payloads, host)
    except kv_transfer.TransferError as e:
        out["missing"] = str(e)
    meta = torch.device("meta")
    payloads = {m.request: rows_of(m.request, meta) for m in mine}  # rows off the group's device (cpu)
    try:
        kv_transfer.transfer(moves, payloads, host)
    except kv_transfer.TransferError as e:
        out["device"] = str(e)
    unprepared = dist.new_group(list(range(world)), backend="gloo")
    payloads = {m.request: rows_of(m.request, torch.device("cpu")) for m in mine}
    try:
        kv_transfer.transfer(moves, payloads, host, unprepared)
    except kv_transfer.TransferError as e:
        out["unprepared"] = str(e)
    dist.barrier(host)
    return out


def timed_rank(rank: int, world: int, backend: str, tokens: int, repeats: int) -> dict:
    """Rank 0 sends one request of ``tokens`` tokens x 61 layers of MLA rows (bf16: DeepSeek-V3's full
    depth) to rank 1, ``repeats`` times after one warm-up; seconds of the fastest."""
    host = dist.new_group(list(range(world)), backend="gloo")
    kv_group = dist.new_group(list(range(world)), backend=backend)
    device = kv_transfer.prepare(kv_group)
    moves = [SimpleNamespace(request=0, src=0, dst=1)]
    rows = [torch.full((tokens, WIDTH), float(i), dtype=torch.bfloat16, device=device) for i in range(61)]
    best = float("inf")
    nbytes = 0
    for k in range(repeats + 1):
        payloads = {0: {"kv": {"num_tokens": tokens, "rows": rows}}} if rank == 0 else {}
        dist.barrier(host)
        torch.cuda.synchronize() if device.type == "cuda" else None
        t0 = time.perf_counter()
        received, sent = kv_transfer.transfer(moves, payloads, host, kv_group)
        torch.cuda.synchronize() if device.type == "cuda" else None
        dt = time.perf_counter() - t0
        if k:
            best = min(best, dt)
        if rank == 1:
            got = received[0]["kv"]["rows"]
            nbytes = sum(r.numel() * r.element_size() for r in got)
            assert all(r.device == device and bool((r == i).all()) for i, r in enumerate(got))
    return {"bytes": nbytes, "seconds": best}
